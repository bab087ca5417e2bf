"""Training that survives, on the SSH lab: real servers killed, real links cut, real leases lapsing.

Each test is bounded (every wait has a deadline), restores any link it cut, and leaves no process
behind (the `home` fixture takes the cluster down and checks every lab host).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    EXAMPLES,
    Barrier,
    Interruptible,
    Train,
    assert_one_line_error,
    dtf,
    epochs_done,
    leftovers,
    saved_on_hosts,
    status_json,
    wait_gone,
)

pytestmark = [pytest.mark.lab, pytest.mark.tf]

# Fake servers (no TensorFlow import, which is slow) where a test is about dtf's own handling of
# tasks and the program never reaches a server, or about what the supervisors do whatever they
# serve (a lease that lapses; the restart limit, tests/fake/test_lifecycle.py): every scenario
# here that a server or the training takes part in runs with TensorFlow's.
FAKE = {"DTF_SERVER": "fake"}


def task_row(home: Path, task: str) -> dict:
    return next(r for r in status_json(home)["tasks"] if r["task"] == task)


# How often a test asks `dtf status` while it waits for a task to change: each call is a dtf
# start and a launcher start on every host: polling often would make much of these tests' CPU.
POLL = 1.0


def wait_serving(home: Path, task: str, after_pid: int, timeout: float = 60) -> dict:
    """Wait until `task` serves again with a server other than `after_pid`; its status row."""
    deadline = time.monotonic() + timeout
    while True:
        row = task_row(home, task)
        if row["state"] == "alive" and row["server_pid"] not in (None, after_pid):
            return row
        assert time.monotonic() < deadline, row
        time.sleep(POLL)


def kill_server(home: Path, task: str) -> int:
    """SIGKILL the task's server; returns once it is gone."""
    pid = task_row(home, task)["server_pid"]
    assert pid
    os.kill(pid, signal.SIGKILL)
    wait_gone([pid])
    return pid


# -- 1. supervision --------------------------------------------------------------------------------

def test_up_on_a_partly_dead_cluster_and_on_a_changed_inventory(lab, write_inventory, home, tmp_path):
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    assert dtf("up", str(inv), home=home, timeout=120, env=FAKE).returncode == 0
    # A whole task dies (supervisor and server: a reboot, a `kill -9 -PGID`).
    os.killpg(task_row(home, "worker:0")["pid"], signal.SIGKILL)
    assert task_row(home, "worker:0")["state"] == "dead"
    ps_pid = task_row(home, "ps:0")["server_pid"]
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    assert r.returncode == 0, r.stderr
    assert "restarted worker:0 (was dead)" in r.stdout
    assert [x["state"] for x in status_json(home)["tasks"]] == ["alive", "alive"]
    assert task_row(home, "ps:0")["server_pid"] == ps_pid

    # The inventory changes: dtf says what differs and changes nothing...
    changed = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                               {"host": "h2", "workers": [w1]}])
    r = dtf("up", str(changed), home=home, timeout=120, env=FAKE)
    assert r.returncode == 8, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0].startswith(f"dtf: error: cluster 'lab' is up from {inv}, and {changed} differs")
    assert r.stderr.splitlines()[1:] == ["  host h2: added",
                                         f"  task worker:1: added on h2 at {lab.host('h2').address}:{w1}"]
    assert lab.processes("h2") == [] and task_row(home, "ps:0")["server_pid"] == ps_pid
    # ... unless told to replace the cluster.
    r = dtf("up", "--replace", str(changed), home=home, timeout=180, env=FAKE)
    assert r.returncode == 0, r.stderr
    assert [x["task"] for x in status_json(home)["tasks"]] == ["ps:0", "worker:0", "worker:1"]
    assert task_row(home, "ps:0")["server_pid"] != ps_pid


HELD_PYTHON = """#!{python}
# This test's python on the hosts: as the real one, except that a server's start waits until the
# test has pressed Ctrl-C: a barrier, not a race with how fast the servers start.
import os, sys, time
if sys.argv[2:3] in (["serve"], ["fake"]):
    open(os.path.join({where!r}, f"reached-{{os.getpid()}}"), "w").close()
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join({where!r}, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def test_ctrl_c_during_up_rolls_back(lab, write_inventory, home, tmp_path):
    held = tmp_path / "held"
    held.mkdir()
    python = tmp_path / "python"
    python.write_text(HELD_PYTHON.format(python=sys.executable, where=str(held)))
    python.chmod(0o755)
    ports = lab.ports(3)
    inv = write_inventory([{"host": h, "workers" if i else "ps": [p]}
                           for i, (h, p) in enumerate(zip(("h0", "h1", "h2"), ports))], python=str(python))
    up = Interruptible("up", str(inv), env={**os.environ, "DTF_HOME": str(home), **FAKE})
    try:
        up.wait_for("starting 1 server(s)")
        deadline = time.monotonic() + 120
        while not list(held.glob("reached-*")):  # a server is being started: Ctrl-C now
            assert up.proc.poll() is None and time.monotonic() < deadline, up.seen
            time.sleep(0.05)
        up.ctrl_c()
    finally:
        (held / "release").write_text("")  # the servers start (and `up` rolls them back) now
    code, err = up.finish(timeout=120)
    assert code == 130, err
    assert "Traceback" not in err and "dtf: error: interrupted" in err
    assert leftovers(lab) == {}
    assert not (home / "state" / "lab.json").exists()
    for h in lab.hosts:
        assert not Path(h.workdir, "lab").exists(), list(Path(h.workdir, "lab").rglob("*"))


# -- 2. a lost worker ------------------------------------------------------------------------------

def test_a_worker_killed_mid_training_costs_only_time(lab, write_inventory, home, tmp_path):
    """The coordinator retries the lost worker's steps elsewhere; the supervisor restarts it on
    its port; the coordinator takes it back. Also: the lease (ttl 20s) is renewed by `dtf train`
    for the whole run, which lasts longer than that (the program is held at the barrier until it
    has run for more than the ttl: on any machine, not only a slow one)."""
    ttl = 20
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    assert dtf("up", "--ttl", f"{ttl}s", str(inv), home=home, timeout=120).returncode == 0
    epochs = 4
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{epochs} done")  # the kill lands mid-training
    t_train = time.monotonic()
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "fit"),
                *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(epochs), "--steps-per-epoch", "40",
                              "--no-export"))
    with barrier.held(run):
        t0 = time.monotonic()
        killed = kill_server(home, "worker:1")
        time.sleep(max(0.0, t_train + ttl + 2 - time.monotonic()))  # the run outlasts a lease
    row = wait_serving(home, "worker:1", killed)
    print(f"worker:1 serving again {time.monotonic() - t0:.1f}s after SIGKILL")
    code, text = run.finish()
    assert code == 0, text[-5000:]
    assert "lost during attempt" not in text  # no rerun: only a worker was lost
    assert epochs_done(text) == [(e, 1) for e in range(1, epochs + 1)]
    s = json.loads((tmp_path / "fit" / "summary.json").read_text())
    assert s["steps"] >= epochs * 40 and s["final_loss"] < 0.5 * s["first_loss"], s
    row = task_row(home, "worker:1")
    assert (row["state"], row["restarts"], row["last_exit"]) == ("alive", 1, "killed by SIGKILL")
    assert all(r["state"] == "alive" for r in status_json(home)["tasks"])  # the lease held


# -- 3. a lost ps ----------------------------------------------------------------------------------

def test_a_lost_ps_resumes_from_the_last_checkpoint(lab, write_inventory, home, tmp_path):
    """Each example resumes in its own way (model.fit from BackupAndRestore's backup, the custom
    loop from its CheckpointManager's checkpoint): one after the other, on one cluster."""
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    assert dtf("up", str(inv), home=home, timeout=120).returncode == 0
    for lost, example in enumerate(["mnist_fit.py", "custom_loop.py"], 1):
        lose_the_ps_mid_training(home, tmp_path / example, example)
        assert task_row(home, "ps:0")["restarts"] == lost


def lose_the_ps_mid_training(home: Path, tmp_path: Path, example: str) -> None:
    epochs, steps = 4, 40
    # The program waits at the end of epoch 2 until the ps is dead (with automatic packing, a fast
    # machine finished every epoch before the kill).
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{epochs} done")
    export = ("--no-export",) if example == "mnist_fit.py" else ()  # what is tested here is the resume
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *barrier.argv(EXAMPLES / example, "--epochs", str(epochs), "--steps-per-epoch", str(steps), *export))
    with barrier.held(run):
        t_kill = time.monotonic()
        kill_server(home, "ps:0")
    t_back = run.wait_for(r"running the program again \(attempt 2 of 3\)")
    code, text = run.finish()
    assert code == 0, text[-5000:]
    print(f"{example}: ps:0 killed -> program rerun in {t_back - t_kill:.1f}s")
    assert "dtf: ps:0 (server killed by SIGKILL) lost during attempt 1 of 3" in text

    done = epochs_done(text)
    first = [e for e, a in done if a == 1]
    second = [e for e, a in done if a == 2]
    assert first == list(range(1, len(first) + 1)) and len(first) >= 2
    assert second == list(range(second[0], epochs + 1))
    # Nothing was skipped (the run ends at exactly the epochs asked) and at most the epoch that was in
    # progress when the ps died is done again: each epoch is backed up before it is reported,
    # so the resumed run starts right after the last one reported (or after the one whose
    # report the kill interrupted).
    assert first[-1] + 1 <= second[0] <= first[-1] + 2, done
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["attempt"] == 2
    assert s["steps"] == epochs * steps, s  # exactly what was asked, not more, not fewer
    if example == "custom_loop.py":
        assert f"resumed at step {(second[0] - 1) * steps}/{epochs * steps}" in text
        assert s["resumed_at_step"] == (second[0] - 1) * steps
    else:
        assert s["epochs_this_attempt"] == epochs - second[0] + 1
        assert s["eval_accuracy"] > 0.8, s


def test_a_program_that_fails_on_its_own_is_not_run_again(lab, write_inventory, home, tmp_path):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    assert dtf("up", str(inv), home=home, timeout=120, env=FAKE).returncode == 0  # the program never reaches them
    program = tmp_path / "bad.py"
    program.write_text("import sys\nprint('attempt', flush=True)\nsys.exit(3)\n")
    r = dtf("train", str(program), home=home, timeout=120)
    assert r.returncode == 3 and r.stdout.count("attempt") == 1 and "lost" not in r.stderr


# -- 4. a lost laptop ------------------------------------------------------------------------------

def test_an_abandoned_cluster_stops_itself_when_its_lease_lapses(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    ttl = 20
    # Fake servers: each supervisor ends its task when the lease lapses, whatever the task serves.
    assert dtf("up", "--ttl", f"{ttl}s", str(inv), home=home, timeout=120, env=FAKE).returncode == 0
    hosts = ("h0", "h1")

    def renewed(host: str) -> float:  # {ttl, renewed} of that host's lease: this machine's clock
        return float(json.loads(Path(lab.host(host).workdir, "lab", "lease.json").read_text())["renewed"])

    # A laptop that comes back in time finds its cluster intact: any dtf command renews. The test
    # reads when each renewal happened from the leases themselves, so a `dtf status` slow to start on
    # a busy machine moves the test's points with it instead of racing them: the renewal only has to
    # come within the lease (it starts 4 s after `up`'s, 16 s before that one lapses).
    by_up = {h: renewed(h) for h in hosts}
    time.sleep(max(0.0, max(by_up.values()) + 4 - time.time()))
    assert [r["state"] for r in status_json(home)["tasks"]] == ["alive", "alive"]
    by_status = {h: renewed(h) for h in hosts}
    assert all(by_status[h] >= by_up[h] + 4 for h in hosts), (by_up, by_status)
    # Then nothing renews it: each task stops itself (each supervisor reads its host's lease every
    # second) once the renewed lease lapsed, not the one `up` gave: each host's tasks are first seen
    # gone after its own renewed lease's end (each host's lease is renewed at its own moment; a busy
    # machine only sees the end later), and the last one removes dtf's files.
    deadline = max(by_status.values()) + ttl + 20
    gone: dict[str, float] = {}
    while len(gone) < len(hosts):
        for h in hosts:
            if h not in gone and not lab.processes(h):
                gone[h] = time.time()
        assert time.time() < deadline, "the tasks outlived the renewed lease"
        time.sleep(0.25)
    assert all(gone[h] >= by_status[h] + ttl for h in hosts), (by_up, by_status, gone)
    while leftovers(lab) or any(Path(h.workdir, "lab").exists() for h in lab.hosts[:2]):
        assert time.time() < deadline, (leftovers(lab), [list(Path(h.workdir).rglob("*")) for h in lab.hosts])
        time.sleep(0.25)
    print(f"hosts cleared {time.time() - (max(by_status.values()) + ttl):.1f}s after the lease lapsed")
    r = dtf("status", home=home, timeout=60)
    assert r.returncode == 7 and "dtf's files are gone" in r.stderr and "lease lapsed" in r.stderr
    # `dtf up` brings it back from the same record; `dtf down` then stops it as usual.
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    assert r.returncode == 0 and "restarted ps:0 (was dead), worker:0 (was dead)" in r.stdout, r.stderr
    assert dtf("down", home=home, timeout=120).returncode == 0
    assert leftovers(lab) == {}


# -- 5. a partitioned host -------------------------------------------------------------------------

def test_a_worker_host_cut_off_for_20s_mid_training(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    assert dtf("up", str(inv), home=home, timeout=120).returncode == 0
    epochs, steps = 5, 30
    # The cut lands after epoch 1 and ends before epoch 4: the program waits at each point until
    # the test has cut the link, or brought it back (training on alone meanwhile).
    cut, back = Barrier(tmp_path / "cut", r"^epoch 1/5 done"), Barrier(tmp_path / "back", r"^epoch 3/5 done")
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *cut.argv(EXAMPLES / "custom_loop.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                          then=(back,)))
    try:
        with cut.held(run):
            lab.link_down("h2")
        time.sleep(20)
        assert run.proc.poll() is None, run.text()[-4000:]  # still training, on the other worker
    finally:
        lab.link_up("h2")
        back.release()
    code, text = run.finish(timeout=400)
    assert code == 0, text[-5000:]
    assert "lost during attempt" not in text
    assert epochs_done(text) == [(e, 1) for e in range(1, epochs + 1)]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["steps"] == epochs * steps and s["final_loss"] < 0.5 * s["first_loss"], s
    assert list((tmp_path / "out" / "checkpoints").glob("ckpt-*.index"))  # saved here...
    assert saved_on_hosts(lab, "lab") == []  # ... and nothing on the hosts
    assert [r["state"] for r in status_json(home)["tasks"]] == ["alive"] * 3


# -- 6. bounded waits ------------------------------------------------------------------------------

def test_train_against_a_dead_cluster_fails_fast_naming_the_tasks(lab, write_inventory, home, tmp_path):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    assert dtf("up", str(inv), home=home, timeout=120, env=FAKE).returncode == 0  # killed before the run
    for task in ("ps:0", "worker:0"):
        os.killpg(task_row(home, task)["pid"], signal.SIGKILL)
    r = dtf("train", str(EXAMPLES / "custom_loop.py"), home=home, timeout=120)  # (its timeout: a hang)
    assert_one_line_error(r, 7, f"ps:0 (h0, {lab.host('h0').address}:{ps})",
                          f"worker:0 (h1, {lab.host('h1').address}:{w0})")
