"""`dtf train --collective` on the SSH lab: the program runs on the hosts, one copy per worker,
from a directory no host sees (lab.laptop_dir), and its chief's output comes back here."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess

import pytest

from helpers import EXAMPLES, PROGRAMS, REPO, Barrier, Train, dtf, status_json, wait_gone

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.slow]


def program_on_laptop(lab, name):
    where = lab.laptop_dir(name)
    shutil.copy(EXAMPLES / "simple_worker_mnist.py", where / "simple_worker_mnist.py")
    return where / "simple_worker_mnist.py"


def held_program_on_laptop(lab, name, barrier, *args):
    """simple_worker_mnist.py with tests/e2e/programs/barrier.py beside it, in a laptop directory
    no host sees: the command line for `dtf train --collective` (the copies wait at `barrier`)."""
    prog = program_on_laptop(lab, name)
    shutil.copy(PROGRAMS / "barrier.py", prog.parent / "barrier.py")
    return [str(prog.parent / "barrier.py"), *barrier.argv(prog.name, *args)[1:]]


def program_from_tests(lab, name, program):
    """One of tests/e2e/programs, in a laptop directory no host sees."""
    where = lab.laptop_dir(name)
    shutil.copy(PROGRAMS / program, where / program)
    return where / program


def up_workers(lab, write_inventory, home, *hosts):
    """`dtf up` of one worker task on each of these hosts; the tasks' ports. The copies are the
    TensorFlow of these tests: the worker servers `up` starts are only stopped for the run and
    started again after it (the same code whatever serves), so fake ones do (no TensorFlow
    import, which is slow, twice per task)."""
    ports = lab.ports(len(hosts))
    inv = write_inventory([{"host": h, "workers": [p]} for h, p in zip(hosts, ports)])
    r = dtf("up", str(inv), home=home, timeout=300, env={"DTF_SERVER": "fake"})
    assert r.returncode == 0, r.stderr
    return ports


def runner_processes(lab, host):
    """The program copies on a host (not their supervisors, whose command line holds the copy's)."""
    return [(pid, cmd) for pid, cmd in lab.processes(host) if "dtf.program.runner" in cmd and "supervise-program" not in cmd]


def test_collective_learns_on_three_hosts_and_brings_the_chief_output_back(lab, write_inventory, home, tmp_path):
    up_workers(lab, write_inventory, home, "h0", "h1", "h2")
    prog = program_on_laptop(lab, "collective-learn")
    out = tmp_path / "out"
    r = dtf("train", "--collective", "--output", str(out), str(prog), "--epochs", "3", "--steps", "30",
            home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Output streamed here, prefixed per task.
    assert "[worker:0 h0] epoch 2 done" in r.stdout, r.stdout[-3000:]
    assert any(line.startswith("[worker:2 h2] ") for line in r.stdout.splitlines())
    # Without TensorFlow's C++ INFO and WARNING lines, as under `dtf train` (dtf.program.noise).
    copies = [line.split("] ", 1)[1] for line in r.stdout.splitlines() if line.startswith("[worker:")]
    assert not [x for x in copies if x.startswith(("I0000 ", "W0000 "))], r.stdout[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["workers"] == 3 and s["loss"][-1] < 0.7 * s["loss"][0], s
    assert (out / "keras-model" / "saved_model.pb").exists()
    assert not (out / "workertemp_1").exists()
    # Each task's log stays on its host; the worker servers serve again; nothing else runs.
    log = dtf("logs", "worker:2", "-n", "400", home=home, timeout=60)
    assert "the program exited with code 0" in log.stdout, log.stdout[-2000:]
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 3
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)
    for i, h in enumerate(lab.hosts):  # the workers' output directories are gone
        assert not lab.exists(h, f"{h.workdir}/lab/worker-{i}/out")


def test_a_killed_worker_restarts_all_and_they_resume(lab, write_inventory, home, tmp_path):
    up_workers(lab, write_inventory, home, "h0", "h1")
    barrier = Barrier(tmp_path / "barrier", r"^epoch 1 done")  # the chief waits there until the kill
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--collective", "--attempts", "2", "--output", str(out),
                *held_program_on_laptop(lab, "collective-resume", barrier, "--epochs", "5", "--steps", "10"),
                cwd=REPO)  # no --epoch-sleep to be killable in: the barrier holds the chief for the kill
    with barrier.held(run):
        victims = runner_processes(lab, "h1")
        assert victims
        for pid, _ in victims:
            subprocess.run(["kill", "-9", str(pid)])
        wait_gone([pid for pid, _ in victims])
    code, text = run.finish(timeout=600)
    dtf_lines = "\n".join(x for x in text.splitlines() if x.startswith("dtf:"))
    assert code == 0, text[-4000:]
    assert "worker:1 (h1) failed first: killed by SIGKILL" in text, dtf_lines
    assert "attempt 2 of 2" in text
    epochs = [line.split() for line in (out / "epochs.txt").read_text().splitlines()]
    first = [int(e[3]) for e in epochs if e[1] == "1"]
    second = [int(e[3]) for e in epochs if e[1] == "2"]
    assert first and second and second[0] == first[-1] + 1, epochs  # resumed, not from the start
    assert sorted(set(first + second)) == list(range(5)) and second[-1] == 4, epochs
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)


def test_a_blocked_port_ends_in_the_start_deadline_naming_the_task(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("needs network namespaces (nft on a host)")
    ports = up_workers(lab, write_inventory, home, "h0", "h2")
    prog = program_on_laptop(lab, "collective-blocked")
    lab.nft("h2", f"table inet dtftest {{\n chain input {{\n  type filter hook input priority 0;\n"
                  f"  iifname != \"lo\" tcp dport {ports[1]} drop\n }}\n}}\n")
    try:
        r = dtf("train", "--collective", "--join-timeout", "60", "--output", str(tmp_path / "out"), str(prog),
                home=home, timeout=400)
    finally:
        lab.nft("h2", "delete table inet dtftest")
    # TensorFlow may give up on the peer before the deadline: either way, dtf names the blocked task.
    assert r.returncode == 1, r.stderr
    error = r.stderr.strip().splitlines()[-1]
    assert error.startswith("dtf: error: ") and "worker:1 (h2) is not reachable at" in error and "from h0" in error, error
    # The program's own traceback streams like the rest of its output (prefixed); dtf shows none.
    assert not [x for x in (r.stdout + r.stderr).splitlines() if "Traceback" in x and not x.startswith("[worker:")]
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)


def test_sync_batch_normalization_trains_with_statistics_of_the_global_batch(lab, write_inventory, home, tmp_path):
    up_workers(lab, write_inventory, home, "h0", "h1")
    prog = program_from_tests(lab, "collective-syncbn", "sync_bn.py")
    r = dtf("train", "--collective", "--output", str(tmp_path / "out"), str(prog), home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen: dict[tuple[str, str], list[str]] = {}
    for line in r.stdout.splitlines():  # "[worker:1 h1] synced SyncBatchNormalization moving_variance ... loss a -> b"
        if line.startswith("[worker:") and " moving_variance " in line:
            task, words = line.split("]")[0][1:].split()[0], line.split("] ", 1)[1].split()
            seen[(task, words[0])] = words
    assert set(seen) == {(t, m) for t in ("worker:0", "worker:1") for m in ("synced", "plain")}, r.stdout[-3000:]
    synced0, synced1 = seen[("worker:0", "synced")], seen[("worker:1", "synced")]
    assert "Sync" in synced0[1] or synced0[1] == "BatchNormalization", synced0
    variance = slice(3, synced0.index("loss"))
    assert synced0[variance] == synced1[variance], (synced0, synced1)  # one global estimate everywhere
    # The global batch spans both workers' data (N(0, 1) and N(3, 1)): variance 3.25; each
    # worker's own batch has variance 1, which plain BatchNormalization sees.
    assert all(2.5 < float(v) < 4.0 for v in synced0[variance]), synced0
    assert all(0.6 < float(v) < 1.5 for v in seen[("worker:0", "plain")][variance]), seen[("worker:0", "plain")]
    loss = synced0[synced0.index("loss") + 1:]
    print(f"SyncBatchNormalization model: loss {loss[0]} -> {loss[2]}")
    assert float(loss[2]) < 0.7 * float(loss[0]), synced0  # it learns


def test_ctrl_c_stops_every_copy_and_preemption_checkpoint_handler_saves(lab, write_inventory, home, tmp_path):
    up_workers(lab, write_inventory, home, "h0", "h2")
    prog = program_from_tests(lab, "collective-ctrl-c", "preempted.py")
    out = tmp_path / "out"
    run = Train(home, tmp_path / "train.out", "--collective", "--output", str(out), str(prog), cwd=REPO)
    run.wait_for(re.escape("[worker:1 h2] step 30 "), timeout=400)
    run.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    code, text = run.finish(timeout=120)
    assert code == 130, text[-4000:]
    assert "dtf: stopping every copy: interrupted" in text and "dtf: interrupted: every copy was stopped" in text
    # TERM reached the copies: TensorFlow's handler saved a checkpoint (the program saves nothing
    # else), and the chief's came back.
    assert (out / "ckpt" / "checkpoint").exists(), text[-4000:]
    assert any(p.name.endswith(".index") for p in (out / "ckpt").iterdir()), sorted((out / "ckpt").iterdir())
    assert "Traceback" not in text, text[-4000:]
    # Nothing is left on any host: no copy, no output directory; the worker servers serve again.
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)
    for h, i in [(lab.hosts[0], 0), (lab.hosts[2], 1)]:
        assert not lab.exists(h, f"{h.workdir}/lab/worker-{i}/out")
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 2


def test_a_host_lost_mid_run_ends_the_run_naming_it_and_down_cleans_it(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("needs network namespaces (a host's link cut)")
    up_workers(lab, write_inventory, home, "h0", "h1")
    barrier = Barrier(tmp_path / "barrier", r"^epoch 1 done")  # the chief waits there until the cut
    run = Train(home, tmp_path / "train.out", "--collective", "--output", str(tmp_path / "out"),
                *held_program_on_laptop(lab, "collective-host-lost", barrier, "--epochs", "100", "--steps", "10",
                                        "--epoch-sleep", "1"), cwd=REPO)
    try:
        with barrier.held(run):
            lab.link_down("h1")  # the host is gone: no word from it, no TCP reset
        code, text = run.finish(timeout=300)
    finally:
        lab.link_up("h1")
    # dtf names h1 as lost, by whichever comes first: its follower hearing nothing for host_lost
    # seconds, or the SSH master to h1 ending (its keepalives unanswered: 15 s) and with it the
    # follower's session. As h1 is still unreachable, no attempt again (--attempts is 3) could
    # join: it ends.
    dtf_lines = "\n".join(x for x in text.splitlines() if x.startswith("dtf:") or x.startswith("  h1:"))
    print(dtf_lines)
    assert code == 4, text[-4000:]
    assert re.search(r"dtf: worker:1 \(h1\) failed first: host lost: (no word from h1 for [\d.]+s"
                     r"|the session to h1 ended before the program did)", text), dtf_lines
    assert "dtf: error: starting every copy again (copying the chief's backup to every worker) failed on 1 host(s):\n  h1: unreachable" \
        in text, dtf_lines
    assert runner_processes(lab, "h0") == []  # the copy that was left stopped
    # h1's copy ran on alone while its host was cut off; `dtf down` leaves nothing there either.
    assert dtf("down", home=home, timeout=300).returncode == 0
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)


def test_a_copy_that_never_joins_ends_at_the_start_deadline_naming_it(lab, write_inventory, home, tmp_path):
    ports = up_workers(lab, write_inventory, home, "h0", "h1")
    prog = program_from_tests(lab, "collective-late", "late_joiner.py")
    r = dtf("train", "--collective", "--join-timeout", "30", "--output", str(tmp_path / "out"), str(prog),
            home=home, timeout=400)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    error = r.stderr.strip().splitlines()[-1]
    assert error.startswith("dtf: error: start deadline (30s, --join-timeout) passed: "), error
    assert f"worker:1 (h1) never listened on port {ports[1]} (see `dtf logs worker:1`)" in error, error
    assert "worker:0 (h0) waited for the others" in error, error
    assert "[worker:1 h1] stuck before the strategy" in r.stdout
    # Every copy was stopped (the stuck one too) and the worker servers serve again.
    assert all(runner_processes(lab, h) == [] for h in lab.hosts)
    assert [t["state"] for t in status_json(home)["tasks"]] == ["alive"] * 2
