"""Runs that outlive their machines, on the SSH lab: a supervisor SIGKILLed mid-training is
brought back by `dtf train`; a host cut off for good has its tasks moved to a spare; no spare
left ends the run with one line. Real sshd, real TensorFlow servers, training that trains.

A host "lost for good" is its link taken down and its dtf processes killed (a dead machine); the
link comes back at the end of the test, so that the lab is whole for the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import yaml

from helpers import EXAMPLES, REPO, Barrier, Train, dtf, status_json, wait_gone, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.tf]

HOST_TIMEOUT = 10  # seconds: the tests' `host_timeout`
POLL = 1.0


def task_row(home: Path, task: str) -> dict:
    return next(r for r in status_json(home)["tasks"] if r["task"] == task)


def with_spares(inv: Path, lab, spares: list[str]) -> Path:
    """The lab inventory `inv` with `spares:` (each in its lab workdir) and the tests' host_timeout."""
    doc = yaml.safe_load(inv.read_text())
    doc["spares"] = [{"host": h, "workdir": lab.host(h).workdir} for h in spares]
    doc["host_timeout"] = HOST_TIMEOUT
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inv


def come_back(lab, host: str) -> None:
    """The lost host's link up again, and its dtf files gone (a new machine at the same address)."""
    lab.link_up(host)
    shutil.rmtree(Path(lab.host(host).workdir, "lab"), ignore_errors=True)


def lose_for_good(lab, host: str) -> None:
    """The host is gone: its link down, and every dtf process on it killed."""
    lab.link_down(host)
    pids = [pid for pid, _ in lab.processes(host)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(pids)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# -- a supervisor killed ---------------------------------------------------------------------------

def test_a_killed_supervisor_is_brought_back_and_the_run_completes(lab, write_inventory, home, tmp_path):
    """A worker's supervisor, then the ps's, each killed during a run of its own on one cluster."""
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    assert dtf("up", str(inv), home=home, timeout=120).returncode == 0
    for task in ("worker:1", "ps:0"):
        kill_a_supervisor_mid_training(home, tmp_path / task.replace(":", "-"), task)


def kill_a_supervisor_mid_training(home: Path, tmp_path: Path, task: str) -> None:
    epochs, steps = 4, 30
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{epochs} done")
    # A worker lost trains on without the program stopping: the program waits before its last
    # epoch until dtf has brought the task back (a fast machine trained to the end before, and the
    # test saw the run end first). A lost ps ends the attempt: the task is back before the next.
    back = Barrier(tmp_path / "back", rf"^epoch 3/{epochs} done")
    then = (back,) if task.startswith("worker") else ()
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--output", str(out),
                *barrier.argv(EXAMPLES / "custom_loop.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                              then=then))
    try:
        with barrier.held(run):
            before = task_row(home, task)
            os.kill(before["pid"], signal.SIGKILL)  # the supervisor: its server goes with it (PDEATHSIG)
            wait_gone([before["pid"]])
        run.wait_for(rf"{task} on h\d started again \(supervisor is gone\)")
    finally:
        back.release()
    code, text = run.finish(timeout=400)
    assert code == 0, text[-5000:]
    s = summary(out)
    assert s["steps"] == epochs * steps, s  # no step counted twice, none skipped
    row = task_row(home, task)
    assert row["state"] == "alive" and row["pid"] != before["pid"], row
    assert row["recovered"].startswith("restarted by dtf at ") and "(supervisor is gone)" in row["recovered"]
    if task.startswith("worker"):  # the coordinator took the worker back: no second attempt
        assert "lost during attempt" not in text
    else:  # the ps lost its variables: the next attempt resumes from the last checkpoint
        assert f"dtf: {task} (not serving) lost during attempt 1 of 3" in text \
            or f"dtf: {task} (server restarted) lost during attempt 1 of 3" in text, text[-4000:]
        assert s["attempt"] == 2 and s["resumed_at_step"] >= 2 * steps, s
    r = dtf("status", home=home, timeout=60)
    assert r.returncode == 0 and f"{task}: restarted by dtf at " in r.stdout, r.stdout


# -- a host lost for good ----------------------------------------------------------------------------

def test_a_worker_host_lost_for_good_moves_to_a_spare(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}]), lab, ["h2"])
    r = dtf("up", str(inv), home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    assert lab.processes("h2") == []  # a spare stands by: nothing runs there
    epochs, steps = 4, 30
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{epochs} done")
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--output", str(out),
                *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps)))
    try:
        with barrier.held(run):
            lose_for_good(lab, "h1")
            t_lost = time.monotonic()
        t_moved = run.wait_for(r"worker:0 moved to spare h2", timeout=HOST_TIMEOUT + 120)
        t_again = run.wait_for(r"running the program again \(attempt 2 of 3\)", timeout=300)
        code, text = run.finish(timeout=400)
    finally:
        come_back(lab, "h1")
    assert code == 0, text[-5000:]
    print(f"h1 lost -> tasks moved {t_moved - t_lost:.1f}s, program again {t_again - t_lost:.1f}s")
    assert "host h1 unanswered for" in text
    s = summary(out)
    assert s["attempt"] == 2 and s["steps"] == epochs * steps, s
    assert s["eval_accuracy"] > 0.8, s
    assert (out / "saved_model").is_dir()  # the final model is on the laptop
    rows = status_json(home)["tasks"]
    assert [(x["task"], x["host"], x["state"]) for x in rows] == [("ps:0", "h0", "alive"), ("worker:0", "h2", "alive")]
    assert rows[1]["address"] == f"{lab.host('h2').address}:{w0}"
    assert rows[1]["recovered"].startswith("moved from h1 to spare h2 at "), rows[1]
    record = json.loads((home / "state" / "lab.json").read_text())
    assert record["plan"]["moved"] == [["h1", "h2"]] and record["plan"]["spares"] == []
    # `dtf up` from the same inventory finds the cluster as it is now: nothing to change.
    r = dtf("up", str(inv), home=home, timeout=120)
    assert r.returncode == 0 and "already up: 2 tasks serving" in r.stdout, (r.stdout, r.stderr)


def test_a_host_that_answers_again_after_its_tasks_moved_has_them_stopped(lab, write_inventory, home, tmp_path):
    """h1 cut off (its processes alive): its worker moves to the spare; h1 answers again while the
    run goes on, and `dtf train` stops the worker it still runs there (which held its port, and
    would have run on until its lease lapsed); after `dtf down`, nothing of the cluster is left on
    it."""
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}]), lab, ["h2"])
    r = dtf("up", str(inv), home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    epochs, steps = 4, 30
    # The cut lands after epoch 2 of attempt 1; the next attempt (on the spare) waits at its last
    # epoch until h1 is clean.
    cut = Barrier(tmp_path / "cut", rf"^epoch 2/{epochs} done")
    end = Barrier(tmp_path / "end", rf"^epoch {epochs}/{epochs} done", attempt=2)
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *cut.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                          "--no-export", then=(end,)))
    try:
        with cut.held(run):
            lab.link_down("h1")
        run.wait_for(r"worker:0 moved to spare h2", timeout=HOST_TIMEOUT + 120)
        assert lab.processes("h1") != []  # its old worker runs on, cut off
        lab.link_up("h1")
        end.wait(run)
        run.wait_for(r"host h1 answers again: the tasks it ran before they moved to spare h2 are stopped",
                     timeout=120)
        assert lab.processes("h1") == []
        end.release()
        code, text = run.finish(timeout=400)
    finally:
        lab.link_up("h1")
        end.release()
    assert code == 0, text[-5000:]
    record = json.loads((home / "state" / "lab.json").read_text())
    assert record["plan"]["retired"] == []  # clean: no longer kept
    assert dtf("down", home=home, timeout=120).returncode == 0
    assert lab.processes("h1") == [] and not Path(lab.host("h1").workdir, "lab").exists()


def test_down_stops_what_a_host_whose_tasks_moved_still_runs(lab, write_inventory, home, tmp_path):
    """The same host back only once the run has ended: `dtf down` stops its old worker; and while
    it does not answer, `dtf down` keeps it in the record and says so."""
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}]), lab, ["h2"])
    assert dtf("up", str(inv), home=home, timeout=120).returncode == 0
    epochs, steps = 3, 20
    cut = Barrier(tmp_path / "cut", rf"^epoch 1/{epochs} done")
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *cut.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                          "--no-export"))
    try:
        with cut.held(run):
            lab.link_down("h1")
        code, text = run.finish(timeout=400)
        assert code == 0 and "worker:0 moved to spare h2" in text, text[-5000:]
        assert lab.processes("h1") != []
        r = dtf("down", home=home, timeout=120)
        assert r.returncode != 0 and "h1:" in r.stderr and "kept in the record" in r.stderr, r.stderr
        lab.link_up("h1")
        r = dtf("down", home=home, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        lab.link_up("h1")
    assert lab.processes("h1") == [] and not (home / "state" / "lab.json").exists()


def test_a_ps_host_lost_for_good_moves_to_a_spare(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}]), lab, ["h2"])
    assert dtf("up", str(inv), home=home, timeout=120).returncode == 0
    epochs, steps = 4, 30
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{epochs} done")
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--output", str(out),
                *barrier.argv(EXAMPLES / "custom_loop.py", "--epochs", str(epochs), "--steps-per-epoch", str(steps)))
    try:
        with barrier.held(run):
            lose_for_good(lab, "h0")
        run.wait_for(r"ps:0 moved to spare h2", timeout=HOST_TIMEOUT + 120)
        code, text = run.finish(timeout=400)
    finally:
        come_back(lab, "h0")
    assert code == 0, text[-5000:]
    s = summary(out)
    assert s["attempt"] == 2 and s["steps"] == epochs * steps, s
    assert s["resumed_at_step"] >= 2 * steps and f"resumed at step {s['resumed_at_step']}" in text, s
    assert [(x["task"], x["host"]) for x in status_json(home)["tasks"]] == [("ps:0", "h2"), ("worker:0", "h1")]


def test_no_spare_left_ends_the_run_with_one_line(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    doc = yaml.safe_load(inv.read_text())
    doc["host_timeout"] = HOST_TIMEOUT
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert dtf("up", str(inv), home=home, timeout=120, env={"DTF_SERVER": "fake"}).returncode == 0
    program = tmp_path / "waits.py"  # the program never reaches the (fake) servers: it waits
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    run = Train(home, tmp_path / "train.out", str(program))
    try:
        run.wait_for("^started")
        lose_for_good(lab, "h2")
        code, text = run.finish(timeout=HOST_TIMEOUT + 300)
    finally:
        lab.link_up("h2")
    assert code == 7, text[-3000:]
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("dtf: error:")]
    assert len(errors) == 1, text
    assert errors[0].startswith("dtf: error: cluster 'lab': host h2 unanswered for "), errors
    assert f"(host_timeout {HOST_TIMEOUT}s) and no spare left to take its tasks (worker:1)" in errors[0]
    # The tasks of the hosts that are left still serve; the lost one is still in the record.
    wait_until(lambda: [x["state"] for x in status_json(home)["tasks"]][:2] == ["alive", "alive"], timeout=60)


# -- collective mode ---------------------------------------------------------------------------------

def test_collective_copies_start_again_on_the_spare_for_a_host_lost_for_good(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    from test_collective import held_program_on_laptop, runner_processes

    w0, w1 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "workers": [w0]}, {"host": "h1", "workers": [w1]}]),
                      lab, ["h2"])
    assert dtf("up", str(inv), home=home, timeout=300, env={"DTF_SERVER": "fake"}).returncode == 0
    barrier = Barrier(tmp_path / "barrier", r"^epoch 1 done")  # the chief waits there until the cut
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--collective", "--attempts", "2", "--output", str(out),
                *held_program_on_laptop(lab, "collective-spare", barrier, "--epochs", "5", "--steps", "10"),
                cwd=REPO)
    try:
        with barrier.held(run):
            lose_for_good(lab, "h1")
        code, text = run.finish(timeout=600)
    finally:
        come_back(lab, "h1")
    dtf_lines = "\n".join(x for x in text.splitlines() if x.startswith("dtf:"))
    assert code == 0, text[-4000:]
    assert "worker:1 moved to spare h2" in text and "attempt 2 of 2" in text, dtf_lines
    assert "[worker:1 h2]" in text  # the copy ran on the spare
    epochs = [line.split() for line in (out / "epochs.txt").read_text().splitlines()]
    first = [int(e[3]) for e in epochs if e[1] == "1"]
    second = [int(e[3]) for e in epochs if e[1] == "2"]
    assert first and second and second[0] == first[-1] + 1, epochs  # resumed from the backup, on the new set
    assert sorted(set(first + second)) == list(range(5)) and second[-1] == 4, epochs
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)
    rows = status_json(home)["tasks"]  # the worker servers serve again, on the new set
    assert [(x["task"], x["host"], x["state"]) for x in rows] == [("worker:0", "h0", "alive"), ("worker:1", "h2", "alive")]


# -- spares at `up` ----------------------------------------------------------------------------------

def test_up_checks_each_spare_and_leaves_nothing_on_it(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    inv = with_spares(write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}]), lab, ["h2"])
    doc = yaml.safe_load(inv.read_text())
    doc["spares"][0]["python"] = "/nonexistent/python3"
    bad = inv.with_name("bad-spare.yaml")
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = dtf("up", str(bad), home=home, timeout=120, env={"DTF_SERVER": "fake"})
    assert r.returncode == 4 and "Traceback" not in r.stderr, r.stderr
    assert "h2: spare: python missing: '/nonexistent/python3' cannot be run there" in r.stderr, r.stderr
    assert not (home / "state" / "lab.json").exists()
    assert lab.processes_of_hosts() == {h.name: [] for h in lab.hosts}
    assert not Path(lab.host("h2").workdir, "lab").exists()
    # A good spare passes the check, and nothing of dtf's stays there.
    r = dtf("up", str(inv), home=home, timeout=120, env={"DTF_SERVER": "fake"})
    assert r.returncode == 0, r.stderr
    assert lab.processes("h2") == [] and not Path(lab.host("h2").workdir, "lab").exists()
