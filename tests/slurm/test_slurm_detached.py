"""`dtf train --detach` and `dtf attach` on the Slurm lab with real TensorFlow: the coordinator is a
job step of the allocation on the node of ps:0, and sees the cluster from there (its srun and
squeue run on the node); the laptop reaches only the login host, and here not even that for a
while: the run trains and ends while the laptop is cut off, and `dtf attach` afterwards prints
every epoch's line once and brings the saved model back. A node lost under the run ends it: the
coordinator runs inside the job, which it never cancels for a new one.

What a node wrote is read here through its slurmd's root (SlurmLab.node_path): the workdir is
on each node's own disk."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from test_comeback import crash
from test_up_down import inventory, job_of, left_behind, ours, steps, workdir

from dtf.errors import ClusterDown
from helpers import EXAMPLES, PROGRAMS, Barrier, dtf, wait_until
from slurmlab import SlurmLab

pytestmark = pytest.mark.tf
EPOCHS = 3
CUT = 20.0  # seconds the laptop stays cut off at least (longer while the run has not ended)


def coordinator(lab: SlurmLab, node: str, cluster: str) -> dict:
    """The run's coordinator as its supervisor says (on the node's own disk); {} before it started."""
    path = lab.node_path(node, f"{workdir(lab)}/{cluster}/chief-0/supervisor.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def ended_on_node(lab: SlurmLab, node: str, cluster: str) -> bool:
    return coordinator(lab, node, cluster).get("state") == "exited"


def output_log(lab: SlurmLab, node: str, cluster: str) -> str:
    return lab.node_path(node, f"{workdir(lab)}/{cluster}/detached/output.log").read_text(errors="replace")


def start(lab: SlurmLab, tmp_path: Path, cluster: str, *args: str) -> tuple[Path, str, Barrier, Path]:
    """`dtf up`, then `dtf train --detach` of mnist_fit.py under a barrier (tests/e2e/programs/barrier.py)
    that holds it after epoch 1: DTF_HOME, the job, the barrier, the laptop's working directory."""
    inv = inventory(lab, tmp_path / "inv.yaml", cluster=cluster)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    # The program and the barrier in the laptop's working directory; the barrier's own folder
    # outside it, on the disk the nodes share with this machine (not /srv).
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(EXAMPLES / "mnist_fit.py", work)
    shutil.copy(PROGRAMS / "barrier.py", work)
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 1/{EPOCHS} done")
    argv = barrier.argv("mnist_fit.py", "--epochs", str(EPOCHS), "--steps-per-epoch", "20")
    r = dtf("train", "--detach", *args, "barrier.py", *argv[1:], home=home, cwd=work, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    node = lab.computes[0].name  # ps:0's
    assert f"runs detached on {node}" in r.stderr, r.stderr
    wait_until(lambda: barrier.reached() or ended_on_node(lab, node, cluster), timeout=300, every=0.5)
    assert barrier.reached(), output_log(lab, node, cluster)[-3000:]  # (not ended before it)
    return home, job, barrier, work


def test_a_detached_run_trains_and_ends_while_the_laptop_is_cut_off(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    home, job, barrier, work = start(slurm_lab, tmp_path, "away", "--output", "fit")
    node = slurm_lab.computes[0].name
    # The coordinator: a job step of the allocation, on ps:0's node
    assert [x.split()[1:] for x in steps(slurm_lab, job) if "-program" in x] == [["dtf-away-program", node]]
    r = dtf("status", home=home, timeout=60)
    assert r.returncode == 0 and f"detached on {node} on slurm job {job}" in r.stdout, r.stdout + r.stderr
    with slurm_lab.laptop_cut():
        barrier.release()
        assert not slurm_lab.connects(None, slurm_lab.login.address, 22)
        t0 = time.monotonic()
        wait_until(lambda: ended_on_node(slurm_lab, node, "away"), timeout=300, every=0.5)
        time.sleep(max(0.0, CUT - (time.monotonic() - t0)))
    r = dtf("attach", home=home, cwd=work, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    epochs = [int(e) for e in re.findall(rf"^epoch (\d+)/{EPOCHS} done", r.stdout, re.M)]
    assert epochs == list(range(1, EPOCHS + 1)), r.stdout[-3000:]
    assert "(attempt 2)" not in r.stdout, r.stdout[-3000:]
    s = json.loads((work / "fit" / "summary.json").read_text())
    assert s["final_loss"] < s["first_loss"], s
    # Its path there is the node's (the program ran there); the model itself is here now.
    assert (work / "fit" / "saved_model" / "saved_model.pb").exists()
    assert list((work / "fit" / "checkpoints").glob("ckpt-*.index"))
    r = dtf("attach", home=home, cwd=work, timeout=120)  # every line printed already: none again
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    r = dtf("status", home=home, timeout=60)
    assert r.returncode == 0 and f"detached on {node}): ended, exited with code 0" in r.stdout, r.stdout + r.stderr
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []


def test_a_lost_node_ends_the_run_and_its_coordinator_never_cancels_its_own_job(slurm_lab: SlurmLab,
                                                                                 tmp_path: Path) -> None:
    """The other node crashes while the program is held after epoch 1. The coordinator is a job
    step of the job that lost the node: it cannot replace it (a new allocation starts by cancelling
    what is left of the old job, the coordinator with it), so it never tries; it ends, saying why
    in one line where it learns of the loss before Slurm ends the job (NODE_FAIL)."""
    home, job, barrier, _ = start(slurm_lab, tmp_path, "lost", "--attempts", "3")
    node, other = (h.name for h in slurm_lab.computes)
    try:
        crash(slurm_lab, other)
        barrier.release()
        wait_until(lambda: ended_on_node(slurm_lab, node, "lost"), timeout=300, every=0.5)
        said = [line for line in output_log(slurm_lab, node, "lost").splitlines() if line.startswith("dtf: ")]
        assert not [line for line in said if "new allocation" in line or "what was left of it" in line], said
        # Where the coordinator learnt of it before the job's end killed it: its last line says why.
        if coordinator(slurm_lab, node, "lost").get("exit_code") == ClusterDown.exit_code:
            assert f"slurm job {job} lost a node" in said[-1], said
        wait_until(lambda: ours(slurm_lab, job) == [], timeout=180, every=1)  # Slurm's to end (NODE_FAIL)
        r = dtf("down", home=home, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        dtf("down", home=home, timeout=120)  # (what an assertion left: the nodes must be idle for the restart)
        slurm_lab.restart_slurmd(other)
    assert left_behind(slurm_lab, timeout=30) == []
