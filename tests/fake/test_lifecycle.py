"""The lifecycle of a cluster, in seconds: fake servers (no TensorFlow) on local processes and on
the SSH lab. Start with its rollback (a failed host, a busy port, Ctrl-C twice), repair, the lease,
and `dtf train`'s decisions (run again after a lost ps, not after the program's own failure; stop
when `dtf down` begins). Real TensorFlow runs the same scenarios in tests/e2e.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from dtf.files.shipping import launcher_bytes, launcher_name
from helpers import Interruptible, assert_one_line_error, fake_server, status_json, stop_train, wait_until
from sites import Site


def rows(site: Site) -> dict[str, dict]:
    return {r["task"]: r for r in status_json(site.home)["tasks"]}


def test_up_status_down(site: Site):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert "cluster fk is up" in r.stdout
    assert {t: r["state"] for t, r in rows(site).items()} == {"ps:0": "alive", "worker:0": "alive",
                                                              "worker:1": "alive"}
    assert site.processes()
    # The lease counts from when the servers serve (not from before they started).
    lease = json.loads((site.workdir("a") / "fk" / "lease.json").read_text())
    ready = json.loads((site.workdir("a") / "fk" / "worker-0" / "ready.json").read_text())
    assert lease["renewed"] >= ready["time"]
    # `dtf status --json`'s schema (docs/watching.md): these fields, in every row.
    doc = status_json(site.home)
    assert (doc["schema"], doc["cluster"]) == (1, "fk")
    for row in doc["tasks"]:
        assert set(row) == {"task", "job", "index", "host", "address", "state", "serving", "pid",
                            "server_pid", "uptime", "restarts", "last_exit", "error", "recovered"}
    # The table reads whole at 80 columns: no cell cut (`10.213…`, `restar…`), no line wider.
    table = site.dtf("status", env={"COLUMNS": "80"})
    assert table.returncode == 0 and "…" not in table.stdout, table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 80, table.stdout
    assert table.stdout.splitlines()[1].split() == ["task", "host", "address", "pid", "state", "uptime", "restarts",
                                                   "last", "exit"], table.stdout
    # The pid column means the same in up's table and in status's: each task's server (not its supervisor).
    up_pids = {line.split()[0]: line.split()[3] for line in r.stdout.splitlines()[2:5]}
    status_pids = {line.split()[0]: line.split()[3] for line in table.stdout.splitlines()[2:5]}
    servers = {row["task"]: str(row["server_pid"]) for row in doc["tasks"]}
    assert up_pids == status_pids == servers, (r.stdout, table.stdout)
    assert all(row["pid"] != row["server_pid"] for row in doc["tasks"])
    # `dtf top --once` through the SSH masters: its table, and nothing of ssh's own (`Shared connection to
    # HOST closed.`).
    top = site.dtf("top", "--once")
    assert top.returncode == 0 and "worker:1" in top.stdout, top.stderr
    assert top.stderr == "", top.stderr
    r = site.dtf("down")
    assert r.returncode == 0 and "3 server(s) stopped on 2 host(s)" in r.stdout, r.stderr
    assert site.processes() == [] and site.files() == []


def test_up_into_one_pipe_says_its_steps_then_its_table(site: Site):
    """`dtf up ... 2>&1 | ...` (a log, CI): the hosts' steps (stderr) all come before the cluster's
    table (stdout), which is whole: nothing of one is written inside the other."""
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    r = subprocess.run([sys.executable, "-m", "dtf", "up", str(inv)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120, env=site.env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("cluster fk is up"))
    steps, result = lines[:first], lines[first:]
    hosts = {site.host("a"), site.host("b")}
    assert steps and all(re.fullmatch(r"  (\S+): .+", line) and line.split(":")[0].strip() in hosts
                         for line in steps), r.stdout
    assert {f"  {h}: done" for h in hosts} <= set(steps), r.stdout
    assert result[1].split() == ["task", "host", "address", "pid", "host", "ready", "in"], r.stdout
    assert [line.split()[0] for line in result[2:5]] == ["ps:0", "worker:0", "worker:1"], r.stdout
    assert len(result) == 6 and result[5].startswith(("network:", "TF ports on this machine:")), r.stdout


def test_a_dead_server_is_restarted_with_backoff_until_the_limit(site: Site):
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}, restart_limit=2, restart_backoff=0.2)
    assert site.dtf("up", str(inv)).returncode == 0
    before = rows(site)
    # Waits read the supervisor's own file (the lab's hosts share this machine's disk); `dtf
    # status` then says what a user sees. The fake servers run on this machine, lab or not.
    supervisor_pid = json.loads(site.record().read_text())["pids"]["worker:0"]
    killed = site.supervisor("b", "worker-0")["server_pid"]
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: site.supervisor("b", "worker-0").get("server_pid") not in (None, killed))
    row = wait_until(lambda: (r := rows(site)["worker:0"])["state"] == "alive" and r)
    assert (row["restarts"], row["last_exit"], row["pid"]) == (1, "killed by SIGKILL", supervisor_pid)
    assert row["address"] == before["worker:0"]["address"]  # the same port: the coordinator takes it back
    log = site.dtf("logs", "worker:0").stdout
    assert "worker:0: server killed by SIGKILL after" in log and "restart 1 of 2 in 0.2s" in log, log
    # A server that keeps dying: the backoff doubles (quick deaths), then the supervisor gives up.
    site.crash("b", "worker-0")
    wait_until(lambda: site.supervisor("b", "worker-0").get("state") == "failed")
    r = site.dtf("status")
    assert r.returncode == 7
    assert "worker:0 (" + site.host("b") + "): gave up after 2 restart(s); last exit: exited with code 3" in r.stderr
    log = site.dtf("logs", "worker:0").stdout
    assert "restart 1 of 2 in 0.2s" in log and "restart 2 of 2 in 0.4s" in log, log
    assert "restart limit (2) reached: giving up" in log
    assert rows(site)["ps:0"]["restarts"] == 0
    # `dtf up` restarts only what is not serving; the ps keeps its process.
    ps_pid = rows(site)["ps:0"]["server_pid"]
    (site.workdir("b") / "fk" / "worker-0" / "crash").unlink()
    r = site.dtf("up", str(inv))
    assert r.returncode == 0 and "restarted worker:0 (was failed)" in r.stdout, r.stderr
    assert "1 task(s) kept running" in r.stdout, r.stdout
    after = rows(site)
    assert {t: (x["state"], x["restarts"]) for t, x in after.items()} == {
        "ps:0": ("alive", 0), "worker:0": ("alive", 0)}
    assert after["ps:0"]["server_pid"] == ps_pid
    # `dtf down` stops supervisors and servers alike.
    r = site.dtf("down")
    assert r.returncode == 0 and "2 server(s) stopped" in r.stdout, r.stderr
    assert site.processes() == []


def test_a_launcher_missing_or_of_another_version_is_replaced_never_misread(local_site: Site):
    site = local_site
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    launcher = site.workdir("a") / "fk" / launcher_name()
    # Another dtf's launcher at this path (it answers in another protocol version)...
    launcher.unlink()
    foreign = site.tmp / "foreign"
    foreign.mkdir()
    (foreign / "__main__.py").write_text('import json\nprint(json.dumps({"protocol": 0, "tasks": {}}))\n')
    subprocess.run([sys.executable, "-m", "zipfile", "-c", str(launcher), str(foreign / "__main__.py")], check=True)
    r = site.dtf("status", "--json")
    assert r.returncode == 0, r.stderr
    assert {t["task"]: t["state"] for t in json.loads(r.stdout)["tasks"]} == {"ps:0": "alive", "worker:0": "alive"}
    assert launcher.read_bytes() == launcher_bytes()  # replaced by this dtf's own
    # ... or none at all (another version of dtf started the cluster): shipped again.
    launcher.unlink()
    assert site.dtf("status").returncode == 0 and launcher.exists()


def test_a_failed_host_rolls_back_the_others(site: Site):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    site.crash("b", "worker-1")  # its server exits at once
    r = site.dtf("up", str(inv))
    assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", f"{site.host('b')}: server crashed: worker:1")
    assert f"{site.host('a')}:" not in r.stderr.split("dtf up failed", 1)[1]
    assert site.processes() == [] and site.files() == []
    assert not site.record().exists()


def test_busy_port_is_refused_and_nothing_is_left(site: Site):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    with site.hold_port("b", site.ports_of("b")[0]):
        r = site.dtf("up", str(inv))
    assert_one_line_error(r, 4, f"{site.host('b')}: port busy: {site.ports_of('b')[0]} (worker:1)")
    assert site.processes() == [] and site.files() == []


def test_gpus_the_host_does_not_have_are_refused_and_nothing_is_left(local_site: Site, tmp_path: Path):
    """A `gpus` key naming a GPU id the host's NVIDIA driver does not list fails `up` for that
    host, in one line (its worker would see no GPU and train on the CPU without a word); with as
    many as it names, `up` goes on. DTF_NVIDIA_GPUS_DIR stands in for /proc/driver/nvidia/gpus."""
    driver = tmp_path / "nvidia-gpus"
    (driver / "0000:01:00.0").mkdir(parents=True)
    env = {"DTF_NVIDIA_GPUS_DIR": str(driver)}
    inv = local_site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 2}}, gpus=2)
    r = local_site.dtf("up", str(inv), env=env)
    reason = "gpus: the inventory gives its workers GPU id 1, but the host's NVIDIA driver lists 1 GPU (id 0)"
    assert_one_line_error(r, 4, "dtf up failed on 2 host(s)", f"a: {reason}", f"b: {reason}")
    assert local_site.processes() == [] and local_site.files() == []
    (driver / "0000:02:00.0").mkdir()
    r = local_site.dtf("up", str(inv), env=env)
    assert r.returncode == 0, r.stderr
    assert local_site.dtf("down").returncode == 0


def test_ctrl_c_twice_during_up_still_rolls_back(site: Site):
    # Servers that serve only once the test has pressed Ctrl-C (a barrier: a file, not a race with
    # how fast they start) and ignore TERM: the first Ctrl-C lands while they start, the second
    # during the rollback, which must still stop everything (KILL after the grace).
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    release = site.tmp / "release"
    up = Interruptible("up", str(inv), env=site.env({"DTF_SERVER": f"fake:ready_file={release},ignore_term"}))
    try:
        up.wait_for("starting ")
        wait_until(lambda: [p for p in site.processes() if fake_server(*p)], timeout=60)  # a server started
        up.ctrl_c()
    finally:
        release.write_text("")
    up.wait_for("stopping servers")  # the rollback has begun
    up.ctrl_c()
    code, err = up.finish(timeout=60)
    assert code == 130, err
    assert "Traceback" not in err and "dtf: error: interrupted" in err
    assert site.processes() == [] and site.files() == []
    assert not site.record().exists()


def test_up_again_restarts_only_the_dead_tasks(local_site: Site):
    site = local_site  # the SSH lab runs this: tests/e2e/test_survival.py
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    before = rows(site)
    os.killpg(before["worker:1"]["pid"], signal.SIGKILL)  # supervisor and server: a whole task
    assert rows(site)["worker:1"]["state"] == "dead"
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert "restarted worker:1 (was dead)" in r.stdout and "2 task(s) kept running" in r.stdout
    after = rows(site)
    assert {t: x["state"] for t, x in after.items()} == {"ps:0": "alive", "worker:0": "alive", "worker:1": "alive"}
    assert [after[t]["pid"] for t in ("ps:0", "worker:0")] == [before[t]["pid"] for t in ("ps:0", "worker:0")]
    # `dtf status` and `dtf top` show what dtf did (the record keeps it).
    assert after["worker:1"]["recovered"].startswith("restarted by dtf at ")
    assert after["worker:1"]["recovered"].endswith("(`dtf up`; was dead)") and after["ps:0"]["recovered"] is None
    r = site.dtf("up", str(inv))
    assert r.returncode == 0 and "is already up: 3 tasks serving" in r.stdout


def test_the_lease_lapses_and_the_hosts_clear_themselves(site: Site):
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    # Servers slower to serve than the lease is long (TensorFlow's import on a busy host): they
    # serve only once the test releases them, a lease (6 s) and more after they were started. The
    # start holds the lease, and it counts from when they serve: after the release, so the hosts
    # cannot clear before release + ttl, however fast or slow this machine is.
    release = site.tmp / "release"
    up = Interruptible("up", "--ttl", "6s", str(inv), env=site.env({"DTF_SERVER": f"fake:ready_file={release}"}))
    try:
        up.wait_for("starting ")
        wait_until(lambda: len([p for p in site.processes() if fake_server(*p)]) == 2, timeout=60)
        time.sleep(7)  # past a lease counted from the start
    finally:
        t_release = time.monotonic()
        release.write_text("")
    code, err = up.finish(timeout=120)
    assert code == 0, err
    wait_until(lambda: not site.processes() and not site.files(), timeout=30)
    assert time.monotonic() - t_release >= 6
    r = site.dtf("status")
    assert r.returncode == 7 and "dtf's files are gone" in r.stderr
    # (A renewed lease, and `dtf up` starting the cluster again: tests/e2e/test_survival.py.)


PROGRAM = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    attempt = int(os.environ["DTF_ATTEMPT"])
    # TensorFlow's C++ chatter, as a real program prints it: dtf leaves it out (dtf.noise).
    print("I0000 00:00:1795433291.552365   18585 cpu_feature_guard.cc:227] chatter", file=sys.stderr, flush=True)
    print("attempt", attempt, flush=True)
    mode = sys.argv[1]
    if mode == "lose-ps" and attempt == 1:
        status = subprocess.run([sys.executable, "-m", "dtf.cli", "status", "--json"],
                                capture_output=True, text=True, timeout=60)
        ps = next(t for t in json.loads(status.stdout)["tasks"] if t["task"] == "ps:0")
        os.kill(ps["server_pid"], signal.SIGKILL)  # its supervisor restarts it
        sys.exit(1)
    if mode == "fail":
        sys.exit(3)
    if mode == "sleep":
        time.sleep(600)
    if mode.startswith("abort-at-exit"):  # as TensorFlow's runtime can, once Python is done
        import ctypes
        libc = ctypes.CDLL(None)
        libc.__cxa_atexit(libc.abort, None, None)  # a C exit handler: after Python is finalized
        sys.exit(int(mode.rsplit("-", 1)[1]))
    if mode == "abort":
        os.abort()
""")


def up_with_program(site: Site, tmp_path: Path, hosts: dict[str, dict[str, int]], **defaults: Any) -> Path:
    """The cluster of `hosts` up on `site`, and PROGRAM written for `dtf train`: its path."""
    inv = site.inventory(hosts, **defaults)
    assert site.dtf("up", str(inv)).returncode == 0
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    return program


def test_train_runs_again_after_a_lost_ps_and_not_after_its_own_failure(local_site: Site, tmp_path: Path):
    site = local_site  # the lab runs this with TensorFlow: tests/e2e/test_survival.py
    program = up_with_program(site, tmp_path, {"a": {"ps": 1}, "b": {"workers": 1}}, restart_backoff=0.1)
    r = site.dtf("train", str(program), "lose-ps")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["attempt 1", "attempt 2"]
    assert "ps:0 (server killed by SIGKILL) lost during attempt 1 of 3" in r.stderr
    r = site.dtf("train", str(program), "fail")
    assert r.returncode == 3 and r.stdout.splitlines() == ["attempt 1"] and "lost" not in r.stderr


def test_a_crash_after_the_program_ended_does_not_hide_its_exit_code(local_site: Site, tmp_path: Path):
    site = local_site
    program = up_with_program(site, tmp_path, {"a": {"ps": 1}, "b": {"workers": 1}})
    for code in (0, 3):
        r = site.dtf("train", str(program), f"abort-at-exit-{code}")
        assert r.returncode == code, r.stderr
        assert r.stdout.splitlines() == ["attempt 1"]
        assert (f"dtf: the program ended with exit code {code}, then was killed by SIGABRT while Python "
                "shut down") in r.stderr
    r = site.dtf("train", str(program), "abort")  # a crash while it runs is the program's end
    assert r.returncode == 134 and "ended with" not in r.stderr, r.stderr


def test_down_while_train_runs_stops_the_program(local_site: Site, tmp_path: Path):
    site = local_site  # the laptop's side alone: the record tells the running train
    program = up_with_program(site, tmp_path, {"a": {"ps": 1}, "b": {"workers": 1}})
    out = open(tmp_path / "train.out", "w")
    train = subprocess.Popen([sys.executable, "-m", "dtf.cli", "train", str(program), "sleep"],
                             env=site.env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "attempt 1" in (tmp_path / "train.out").read_text())
        t0 = time.monotonic()
        assert site.dtf("down").returncode == 0
        code = train.wait(timeout=30)
        print(f"the program stopped {time.monotonic() - t0:.1f}s after dtf down began")
    finally:
        stop_train(train)
        out.close()
    text = (tmp_path / "train.out").read_text()
    assert code != 0 and "is being taken down (`dtf down`): stopping the program" in text, text
    assert site.processes() == []


def test_a_bug_in_a_host_thread_is_an_internal_error(local_site: Site, monkeypatch: pytest.MonkeyPatch):
    """Not "host a: KeyError" (exit 4): one line, exit 1, the traceback in debug.log."""
    from typer.testing import CliRunner

    from dtf.cli import app
    from dtf.hostops.start import Starter

    def broken(self, hp, *args, **kwargs):
        raise KeyError("tasks")

    site = local_site
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    monkeypatch.setenv("DTF_HOME", str(site.home))
    monkeypatch.setattr(Starter, "start_host", broken)
    r = CliRunner().invoke(app, ["up", str(inv)])
    assert r.exit_code == 1, r.output
    # Where it was raised, and the innermost frame of dtf's own code that called it.
    assert re.match(r"dtf: error: internal error: KeyError: 'tasks' \(at fake/test_lifecycle\.py:\d+, "
                    r"from dtf/hostops/start\.py:\d+; traceback in ", r.output), r.output
    assert "in broken" in (site.home / "debug.log").read_text()


def test_down_keeps_the_cache_and_purge_removes_it(site: Site):
    """WORKDIR/.cache (managed environments, wheels, synced trees) outlives a cluster: `down`
    keeps it, `down --purge` removes it on every host."""
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    for name in ("a", "b"):
        shutil.rmtree(site.workdir(name) / ".cache", ignore_errors=True)  # another module's, on a shared lab
        env = site.workdir(name) / ".cache" / "env" / "0123abcd"
        env.mkdir(parents=True)
        (env / "big").write_bytes(b"x" * 2_000_000)
    assert site.dtf("up", str(inv)).returncode == 0
    r = site.dtf("down")
    assert r.returncode == 0, r.stderr
    assert all((site.workdir(n) / ".cache" / "env" / "0123abcd" / "big").exists() for n in ("a", "b"))
    assert site.dtf("up", str(inv)).returncode == 0
    r = site.dtf("down", "--purge")
    assert r.returncode == 0, r.stderr
    assert not any((site.workdir(n) / ".cache").exists() for n in ("a", "b"))
    assert r.stdout.count(": cache removed (2 MB freed)") == 2, r.stdout
    assert site.processes() == [] and site.files() == []


def test_a_collective_copy_that_crashed_after_its_end_keeps_its_exit_code(local_site: Site, tmp_path: Path):
    site = local_site
    program = up_with_program(site, tmp_path, {"a": {"workers": 1}, "b": {"workers": 1}})
    r = site.dtf("train", "--collective", "--output", str(tmp_path / "out"), str(program), "abort-at-exit-0")
    assert r.returncode == 0, r.stdout + r.stderr
    for task, host in (("worker:0", "a"), ("worker:1", "b")):
        said = (f"[{task} {host}] ", f"dtf: {task}: the program exited with code 0, then was killed by SIGABRT "
                "while Python shut down")
        assert all(words in r.stdout for words in said), r.stdout + r.stderr
    assert "cpu_feature_guard" not in r.stdout + r.stderr  # left out, as under `dtf train`
