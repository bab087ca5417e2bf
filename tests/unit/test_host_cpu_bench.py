"""bench/host_cpu.py, the budget that stands where an import ban stood: what a host spends on
`up`'s, `status`'s and `down`'s launcher commands. Checked here that it measures them (each
command run as `up` runs it, its CPU counted, the cluster gone after `down`), never against the
budget: a loaded machine spends more, and the figure goes on docs/benchmarks.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import REPO


def test_one_round_runs_each_command_and_counts_its_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import host_cpu

    data = host_cpu.build_launcher(REPO / "server")
    packages = tmp_path / "packages"
    (packages / "tensorflow-2.99.0.dist-info").mkdir(parents=True)  # (the check looks for it)
    spent = host_cpu.one_round(tmp_path, data, {**os.environ, "PYTHONPATH": str(packages)})
    assert set(spent) == set(host_cpu.BUDGET_MS)
    assert all(ms > 0 for ms in spent.values()), spent
    assert not (tmp_path / "cluster").exists()  # `down` cleaned (one_round exits otherwise)
