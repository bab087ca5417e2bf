"""The Slurm lab (tests/slurmlab.py), one per test process, for every test in this directory.

Every test here is marked `slurm` and `lab`, and all are one xdist group (one test process runs
them). Outside CI, a machine without root, sshd or the Slurm packages skips them with the reason;
under CI=true a Slurm lab that cannot start fails them.
Its name and subnet: DTF_SLURM_LAB_NAME / DTF_SLURM_LAB_SUBNET where set (a lab of your own beside
the session's SSH lab; under pytest-xdist, for the first worker only), else the first free pair of
tests/lab.py's IDENTITIES.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import down_recorded
from lab import Lab, LabError
from slurmlab import SlurmLab, missing


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.lab)
            # One pytest-xdist worker runs them all (`make test`: --dist loadgroup), so one Slurm
            # lab (slurmctld, two slurmd, three munged) is built, not one per worker.
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture(scope="session")
def slurm_lab(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[SlurmLab]:
    ci = os.environ.get("CI") == "true"
    gone = [why for bad, why in [(os.geteuid() != 0, "not root"),
                                 (not os.access("/usr/sbin/sshd", os.X_OK), "no /usr/sbin/sshd"),
                                 (shutil.which("nft") is None, "no nft")] if bad]
    gone += [f"no {p}" for p in missing()]
    if gone:
        reason = "Slurm lab unavailable: " + ", ".join(gone) + " (apt-get install slurmctld slurmd slurm-client munge)"
        if ci:
            pytest.fail(reason + " (CI=true: the Slurm lab is required)")
        pytest.skip(reason)
    Lab.cleanup_stale()
    name, subnet = os.environ.get("DTF_SLURM_LAB_NAME"), os.environ.get("DTF_SLURM_LAB_SUBNET")
    try:
        # As the SSH lab's fixture: under pytest-xdist only the first worker takes the given pair.
        first = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
        # SlurmdTimeout 10 s: the tests that lose a node wait that long (and up to a ping
        # interval, a third of it, more) for Slurm to find it; slurmctld pings a node every few
        # seconds, so one that answers, even on a loaded machine, is never taken for lost.
        lab = SlurmLab(root=tmp_path_factory.mktemp("slurmlab"), name=name, subnet=subnet,
                       pick=not (name and subnet and first), slurmd_timeout=10).__enter__()
    except LabError as e:
        pytest.fail(f"Slurm lab failed: {e}")
    try:
        line = (f"slurm lab {lab.name}: login {lab.login.address}, compute "
                f"{', '.join(h.address for h in lab.computes)} (the laptop reaches only the login's port 22)")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        print(line, file=sys.stderr) if reporter is None else reporter.write_line(line)
        yield lab
    finally:
        lab.close()


@pytest.fixture(autouse=True)
def _down_what_the_test_left(tmp_path: Path) -> Iterator[None]:
    """After each test, `dtf down` every cluster still recorded under its tmp_path (its DTF_HOME):
    one whose assertion failed before its own `down` would leave its allocation and its tasks on
    the nodes' ports, and every Slurm test after it would fail on them (port busy), as one failure
    did in a loaded run."""
    yield
    down_recorded(tmp_path)
