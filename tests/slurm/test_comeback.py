"""Slurm jobs that come back: under `dtf train --attempts N`, a job dtf submitted that ended (a
lost node, a cancellation from outside) is replaced by a new allocation from the same inventory,
and the program's next attempt runs there; a `job:` of the user's own is never replaced, and no
attempt left ends the run in one line.

The fake-server tests use a program without TensorFlow that waits, in its first attempt, until the
test has ended the job (cancelled from outside, as a preemption, or a node's slurmd killed): the
test's fault never races the program. The last test trains for real and loses a node (its slurmd
and everything of the job's there killed, as a crash)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from test_up_down import FAKE, inventory, job_of, left_behind, ours

from helpers import REPO, Train, dtf, status_json, wait_until
from slurmlab import SlurmLab

PROGRAM = """\
import os, sys, time
from collections.abc import Callable
from pathlib import Path

here = Path(sys.argv[1])
attempt = os.environ["DTF_ATTEMPT"]
(here / f"attempt-{attempt}").write_text(os.environ["TF_CONFIG"])
if attempt == "1":  # until the test has ended the job: then fail, as a program whose ps is gone
    deadline = time.monotonic() + 300
    while not (here / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(1)
"""


def program(tmp_path: Path) -> tuple[Path, Path]:
    here = tmp_path / "prog"
    here.mkdir()
    (here / "prog.py").write_text(PROGRAM)
    return here / "prog.py", here


def new_job(text: str) -> str:
    """The job `dtf train` submitted to replace the ended one, from what it said."""
    found = re.search(r"^dtf: job (\d+) submitted", text, re.M)
    assert found, text
    return found.group(1)


def gone(lab: SlurmLab, job: str) -> bool:
    return ours(lab, job) == []


def end_attempt_one(lab: SlurmLab, run: Train, here: Path, job: str, then: Callable[[], None] = lambda: None) -> None:
    """Once the program's first attempt runs: cancel its job from outside (as a preemption does),
    wait until the queue no longer lists it, do `then`, and let the program fail."""
    wait_until(lambda: (here / "attempt-1").exists() or run.proc.poll() is not None, 120)
    assert run.proc.poll() is None, run.text()[-3000:]
    r = lab.slurm(["scancel", job])
    assert r.returncode == 0, r.stderr
    wait_until(lambda: gone(lab, job), 60)
    then()
    (here / "go").write_text("")


def test_no_attempt_left_is_one_line(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="last", nodes=1)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    prog, here = program(tmp_path)
    run = Train(home, tmp_path / "train.log", "--attempts", "1", str(prog), str(here))
    end_attempt_one(slurm_lab, run, here, job)
    code, text = run.finish(timeout=120)
    assert code == 7, text
    errors = [line for line in text.splitlines() if line.startswith("dtf: error:")]
    assert len(errors) == 1 and f"slurm job {job}" in errors[0] and "no attempts left (--attempts 1)" in errors[0], text
    assert "Traceback" not in text and "new allocation" not in text, text
    assert [line for line in slurm_lab.queue() if "dtf-last" in line] == []  # nothing asked for
    r = dtf("down", home=home, env=FAKE, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_new_allocation_pending_past_its_deadline_is_one_line(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """The nodes are taken (by a job of someone else's) when dtf asks for the new allocation: it
    pends; past `--slurm-wait` it is cancelled, and the run ends in one line naming both jobs."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="wait")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    first = job_of(r.stdout)
    prog, here = program(tmp_path)
    run = Train(home, tmp_path / "train.log", "--attempts", "3", "--slurm-wait", "3", str(prog), str(here))
    other: list[str] = []

    def take_the_nodes() -> None:
        r = slurm_lab.slurm(["sbatch", "--parsable", "-N2", "--exclusive", "--output=/dev/null", "--wrap",
                             "exec sleep infinity"])
        assert r.returncode == 0, r.stderr
        other.append(r.stdout.strip())
        wait_until(lambda: ours(slurm_lab, other[0]) == [f"{other[0]} RUNNING"], 60)

    try:
        end_attempt_one(slurm_lab, run, here, first, then=take_the_nodes)
        code, text = run.finish(timeout=120)
        assert code == 7, text
        errors = [line for line in text.splitlines() if line.startswith("dtf: error:")]
        second = new_job(text)
        assert len(errors) == 1, text
        for needle in (f"cluster 'wait': slurm job {first}", "no new allocation",
                       f"job {second} still PENDING after 3s", "cancelled", "`dtf up` starts the cluster anew"):
            assert needle in errors[0], (needle, text)
        assert "Traceback" not in text and not (here / "attempt-2").exists(), text
        assert gone(slurm_lab, second)
        assert not (home / "state" / "wait.json").exists()  # nothing of the cluster is left to take down
    finally:
        for job in other:
            slurm_lab.slurm(["scancel", job])


def test_a_job_of_the_users_own_is_never_replaced(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    r = slurm_lab.slurm(["sbatch", "--parsable", "-N1", "--output=/dev/null", "--wrap", "exec sleep infinity"])
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    try:
        inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="own", job=int(job))
        home = tmp_path / "home"
        r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        prog, here = program(tmp_path)
        run = Train(home, tmp_path / "train.log", "--attempts", "3", str(prog), str(here))
        end_attempt_one(slurm_lab, run, here, job)
        code, text = run.finish(timeout=120)
        assert code == 7, text
        errors = [line for line in text.splitlines() if line.startswith("dtf: error:")]
        assert len(errors) == 1 and f"cluster 'own': slurm job {job}" in errors[0], text
        assert "Traceback" not in text and "new allocation" not in text, text
        assert not (here / "attempt-2").exists()
        assert [line for line in slurm_lab.queue() if line.split()[0] != job] == []  # nothing asked for
        r = dtf("down", home=home, env=FAKE, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        slurm_lab.slurm(["scancel", job])


def test_a_killed_slurmd_gives_a_new_allocation_once_the_node_is_back(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """slurmd killed on one of the job's two nodes (its tasks there live on, orphaned): Slurm ends
    the job (NODE_FAIL) once the node has not answered for SlurmdTimeout, and the other node's tasks
    with it. The new allocation needs both nodes: it pends, saying why, until the node's slurmd is
    back; then the tasks start on both (the orphans gone) and the program runs again."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="node")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    first = job_of(r.stdout)
    lost = slurm_lab.computes[1]
    prog, here = program(tmp_path)
    run = Train(home, tmp_path / "train.log", "--attempts", "2", str(prog), str(here))
    restarted = False
    try:
        wait_until(lambda: (here / "attempt-1").exists() or run.proc.poll() is not None, 120)
        slurm_lab.kill_slurmd(lost)
        wait_until(lambda: gone(slurm_lab, first), 180, every=1)  # NODE_FAIL after SlurmdTimeout
        (here / "go").write_text("")
        run.wait_for(r"^dtf: job \d+: PENDING", timeout=120)
        slurm_lab.restart_slurmd(lost, idle=False)
        restarted = True
        code, text = run.finish(timeout=300)
        assert code == 0, text[-4000:]
        assert f"slurm job {first} lost a node (NODE_FAIL" in text or \
            f"slurm job {first} is no longer in the queue" in text, text
        second = new_job(text)
        assert f"job {second} replaces job {first} (allocation 2 of cluster node)" in text, text
        # The second attempt ran against the new allocation's tasks: the record's, which names the new job.
        tf_config = json.loads((here / "attempt-2").read_text())
        doc = status_json(home)
        assert doc["slurm"]["job"] == second and doc["slurm"]["state"] == "RUNNING", doc
        assert sorted(doc["slurm"]["nodes"]) == sorted(h.name for h in slurm_lab.computes), doc
        assert doc["slurm"]["allocation"] == 2 and doc["slurm"]["replaced"][0].startswith(f"{first}: "), doc
        assert sorted(tf_config["cluster"]["ps"] + tf_config["cluster"]["worker"]) == sorted(
            t["address"] for t in doc["tasks"]), (tf_config, doc)
        assert [t["state"] for t in doc["tasks"]] == ["alive"] * 4, doc
        r = dtf("status", home=home, env=FAKE, timeout=60)
        assert f"slurm job {second} (submitted by dtf; allocation 2, after job {first} ended)" in r.stdout, r.stdout
    finally:
        dtf("down", home=home, env=FAKE, timeout=120)
        if not restarted:
            slurm_lab.restart_slurmd(lost)
    assert left_behind(slurm_lab, timeout=30) == []


def crash(lab: SlurmLab, node: str) -> None:
    """The node goes as in a crash: its slurmd killed (Slurm learns it after SlurmdTimeout), and
    every process of the job's there (slurmstepd, dtf's supervisors and servers) with it."""
    lab.kill_slurmd(node)
    netns = lab.host(node).netns
    assert netns
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if not name.startswith("sshd"):  # the lab's own way in stays
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.tf
def test_a_lost_node_gives_a_new_allocation_and_the_run_completes(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """One node, ps and worker on it: the node crashes after the first epoch; Slurm ends the job
    (NODE_FAIL) once the node has not answered for SlurmdTimeout; dtf asks for a new allocation
    (the other node), and the program resumes from its last checkpoint: the final model lands on
    the laptop, and no step is counted twice."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="crash", nodes=1)
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    first = job_of(r.stdout)
    node = status_json(home)["slurm"]["nodes"][0]
    epochs, steps = 2, 10
    run = Train(home, tmp_path / "train.log", "--attempts", "2", "--output", str(tmp_path / "out"),
                str(REPO / "examples" / "mnist_fit.py"), "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                "--steps-per-execution", "5", cwd=tmp_path)
    try:
        run.wait_for(rf"^epoch 1/{epochs} done", timeout=400)
        crash(slurm_lab, node)
        code, text = run.finish(timeout=600)
        assert code == 0, text[-5000:]
        assert f"slurm job {first} lost a node" in text or f"slurm job {first} is no longer in the queue" in text, text
        second = new_job(text)
        assert f"job {second} replaces job {first}" in text, text
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["attempt"] == 2 and summary["steps"] == epochs * steps, summary  # resumed, no step twice
        assert summary["epochs_this_attempt"] < epochs, summary
        assert Path(summary["saved_model"], "saved_model.pb").exists()  # on the laptop
        r = dtf("down", home=home, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert gone(slurm_lab, second)  # down waits until the queue no longer lists it
        # The lost node's job is Slurm's to end: it may stay COMPLETING until the node is marked down
        wait_until(lambda: gone(slurm_lab, first), 180, every=1)
    finally:
        dtf("down", home=home, timeout=120)  # (what an assertion left: the nodes must be idle for the restart)
        slurm_lab.restart_slurmd(node)
    assert left_behind(slurm_lab, timeout=30) == []
