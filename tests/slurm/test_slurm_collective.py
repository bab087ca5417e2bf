"""`dtf train --collective` on the Slurm lab (real TensorFlow): every copy is a task of ONE job
step of the allocation (`srun --ntasks=N`), so a program that builds SlurmClusterResolver runs
unchanged, as does one that reads TF_CONFIG; output comes back prefixed per task, the chief's
output directory to the laptop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_up_down import inventory, job_of, left_behind, ours, steps

from helpers import EXAMPLES, PROGRAMS, dtf, status_json
from slurmlab import SlurmLab

pytestmark = pytest.mark.tf


def test_collective_runs_slurm_cluster_resolver_and_tf_config_programs(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="coll", ps=0, workers=1)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    h1, h2 = (h.name for h in slurm_lab.computes)
    prog = tmp_path / "prog" / "slurm_resolver.py"
    prog.parent.mkdir()
    shutil.copy(PROGRAMS / "slurm_resolver.py", prog)
    out = tmp_path / "out"
    r = dtf("train", "--collective", "--output", str(out), str(prog), home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[worker:0 {h1}] worker:0 of 2: " in r.stdout and f"[worker:1 {h2}] worker:1 done" in r.stdout, r.stdout
    s = json.loads((out / "summary.json").read_text())  # the chief's, brought back from h1's own disk
    assert s["workers"] == 2 and s["loss"][-1] < s["loss"][0], s
    assert s["cluster"] == {"worker": [f"{h1}:8888", f"{h2}:8888"]}, s  # what Slurm told the resolver
    # A program reading TF_CONFIG (dtf's worker addresses), on the same cluster.
    out2 = tmp_path / "out2"
    r = dtf("train", "--collective", "--output", str(out2), str(EXAMPLES / "simple_worker_mnist.py"),
            "--epochs", "1", "--steps", "10", home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert any(line.startswith(f"[worker:1 {h2}] ") for line in r.stdout.splitlines()), r.stdout
    assert json.loads((out2 / "summary.json").read_text())["workers"] == 2
    # the worker servers serve again; no step of copies is left
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 2
    assert not [x for x in steps(slurm_lab, job) if "program" in x]
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []
