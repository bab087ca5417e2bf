"""`dtf train --collective` on the Slurm lab (real TensorFlow): every copy is a task of ONE job
step of the allocation (`srun --ntasks=N`), so a program that builds SlurmClusterResolver runs
unchanged, as does one that reads TF_CONFIG; output comes back prefixed per task, the chief's
output directory to the laptop. The copies are the TensorFlow here: the worker servers `up`
starts (stopped for a run, started again after it) are fake ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from test_up_down import FAKE, inventory, job_of, left_behind, ours, steps, workdir

from helpers import EXAMPLES, PROGRAMS, REPO, Barrier, Train, dtf, status_json, wait_gone
from lab import Host
from slurmlab import SlurmLab

pytestmark = pytest.mark.tf


def test_collective_runs_a_slurm_cluster_resolver_program_unchanged(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="coll", ps=0, workers=1)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=300)
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
    # (A program reading TF_CONFIG, dtf's worker addresses: the next test's.)
    # the worker servers serve again; no step of copies is left
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 2
    assert not [x for x in steps(slurm_lab, job) if "program" in x]
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []


def copies_on(lab: SlurmLab, node: Host) -> list[int]:
    """The program copies running on a compute node (in its network namespace), not their
    supervisors (whose command lines hold the copy's)."""
    here = set(subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True,
                              timeout=10).stdout.split())
    return [pid for pid, cmd in lab.processes(workdir(lab)) if str(pid) in here
            and "dtf.program.runner" in cmd and "supervise-program" not in cmd and "run-step" not in cmd]


def test_a_killed_copy_restarts_every_copy_and_they_resume(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """Under --collective on Slurm, a copy killed on a node after the program reached a barrier:
    every copy is stopped and started again as a new job step, and they resume from the chief's
    BackupAndRestore backup (copied to the other node's own disk). The program reads TF_CONFIG
    (dtf's worker addresses for each task of the step)."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="again", ps=0, workers=1)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    prog = tmp_path / "prog" / "simple_worker_mnist.py"
    prog.parent.mkdir()
    shutil.copy(EXAMPLES / "simple_worker_mnist.py", prog)
    shutil.copy(PROGRAMS / "barrier.py", prog.parent / "barrier.py")
    barrier = Barrier(tmp_path / "barrier", r"^epoch 1 done")  # every copy waits there until the kill
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--collective", "--attempts", "2", "--output", str(out),
                str(prog.parent / "barrier.py"), *barrier.argv(prog.name, "--epochs", "4", "--steps", "5")[1:],
                cwd=REPO)
    lost = slurm_lab.computes[1]
    with barrier.held(run):
        victims = copies_on(slurm_lab, lost)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        wait_gone(victims)
    code, text = run.finish(timeout=600)
    dtf_lines = "\n".join(x for x in text.splitlines() if x.startswith("dtf:"))
    assert code == 0, text[-4000:]
    assert f"worker:1 ({lost.name}) failed first: killed by SIGKILL" in text, dtf_lines
    assert "attempt 2 of 2" in text, dtf_lines
    epochs = [line.split() for line in (out / "epochs.txt").read_text().splitlines()]
    first = [int(e[3]) for e in epochs if e[1] == "1"]
    second = [int(e[3]) for e in epochs if e[1] == "2"]
    assert first and second and second[0] == first[-1] + 1, epochs  # resumed, not from the start
    assert sorted(set(first + second)) == list(range(4)) and second[-1] == 3, epochs
    assert not [x for x in steps(slurm_lab, job) if "program" in x]
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 2
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0 and ours(slurm_lab, job) == [], r.stdout + r.stderr
    assert left_behind(slurm_lab) == []
