"""dtf end to end over real SSH: the lab's sshd hosts (tests/lab.py), real TF servers, real training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    EXAMPLES,
    REPO,
    as_in_a_terminal,
    assert_one_line_error,
    dtf,
    leftovers,
    pids_alive,
    saved_on_hosts,
    status_json,
)

pytestmark = [pytest.mark.lab, pytest.mark.tf]

# Fake servers (no TensorFlow import, which is slow) where a test is about how dtf reaches and
# drives the hosts, not about what serves on them (the first test runs TensorFlow's). A failing
# `up` starts servers too: on the hosts whose turn came before the failure, rolled back after it.
FAKE = {"DTF_SERVER": "fake"}


def test_up_train_status_logs_down(lab, write_inventory, home, tmp_path):
    ps, w0, w1, w2 = lab.ports(4)
    inv = write_inventory([{"host": "h0", "ps": [ps]},
                           {"host": "h1", "workers": [w0, w1]},  # two workers on one host
                           {"host": "h2", "workers": [w2]}])
    r = dtf("up", str(inv), home=home)
    assert r.returncode == 0, r.stderr
    record = json.loads((home / "state" / "lab.json").read_text())
    addr = {h.name: h.address for h in lab.hosts}
    rows = status_json(home)["tasks"]
    assert [(x["task"], x["host"], x["address"], x["state"], x["serving"]) for x in rows] == [
        ("ps:0", "h0", f"{addr['h0']}:{ps}", "alive", True),
        ("worker:0", "h1", f"{addr['h1']}:{w0}", "alive", True),
        ("worker:1", "h1", f"{addr['h1']}:{w1}", "alive", True),
        ("worker:2", "h2", f"{addr['h2']}:{w2}", "alive", True)]
    # The servers run on the hosts, detached from the SSH sessions that started them: per task,
    # a supervisor and its server.
    assert {h: len(p) for h, p in ((h.name, lab.processes(h)) for h in lab.hosts)} == {"h0": 2, "h1": 4, "h2": 2}
    if lab.mode == "netns":  # the chief is advertised at the laptop's address as the hosts see it
        assert record["chief_host"] == f"{lab.subnet}.1"

    log = dtf("logs", "worker:1", "-n", "50", home=home, timeout=60)
    assert log.returncode == 0 and f"worker:1 serving on port {w1}" in log.stdout
    follow_log_until_interrupted(home, "ps:0", f"ps:0 serving on port {ps}")
    assert log_readers_left(lab, "h0") == []  # following left no reader behind on the host
    assert len(lab.processes("h0")) == 2

    # Relative output paths, given to the programs themselves, from the laptop's working
    # directory: a file written by a server instead of the coordinator would land in that
    # server's own working directory (its task directory), not here.
    # 3 epochs (150 steps): enough to learn, few enough for a CPU-only lab. After 2, the second
    # epoch's mean loss may stay above half the first's (3 workers updating the ps at once, the
    # data's order each worker's own). (The custom loop learns, saves here and resumes on the lab
    # in tests/e2e/test_survival.py.)
    r = dtf("train", str(EXAMPLES / "mnist_fit.py"), "--output", "fit", "--epochs", "3", home=home, timeout=600,
            cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out1 = tmp_path / "fit"
    s = json.loads((out1 / "summary.json").read_text())
    assert s["final_loss"] < 0.5 * s["first_loss"], s
    assert s["eval_accuracy"] > 0.8, s
    assert Path(s["saved_model"], "saved_model.pb").exists()  # landed on the laptop
    assert list((out1 / "checkpoints").glob("ckpt-*.index"))
    assert list((out1 / "logs").rglob("events.out.tfevents.*"))

    assert saved_on_hosts(lab, "lab") == []  # nothing the program saved went to the hosts

    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "4 server(s) stopped on 3 host(s)" in r.stdout
    assert pids_alive(list(record["pids"].values())) == []
    assert leftovers(lab) == {}
    for h in lab.hosts:  # dtf removed what it put on the hosts
        assert not Path(h.workdir, "lab").exists()
    assert not (home / "state" / "lab.json").exists()


def follow_log_until_interrupted(home: Path, task: str, expect: str, sig: int = signal.SIGINT) -> int:
    """`dtf logs TASK -f` prints the log and keeps following until Ctrl-C (SIGINT), or `sig`;
    its exit code. ssh says nothing of its own on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "logs", task, "-f"],
                            env={**os.environ, "DTF_HOME": str(home)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 30
        line = ""
        while expect not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert expect in line
        assert proc.poll() is None  # still following
        proc.send_signal(sig)
        proc.wait(timeout=20)
        assert "Shared connection" not in proc.stderr.read()
        return proc.returncode
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_logs_follow_ends_with_its_reader_on_the_host(lab, write_inventory, home, sig):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    assert dtf("up", str(inv), home=home, timeout=120, env=FAKE).returncode == 0
    code = follow_log_until_interrupted(home, "worker:0", f"worker:0 (fake) serving on port {w0}", sig)
    assert code == (130 if sig == signal.SIGINT else 128 + sig)
    assert log_readers_left(lab, "h1") == []
    assert dtf("down", home=home, timeout=120).returncode == 0

def log_readers_left(lab, host: str, timeout: float = 10) -> list:
    """The launcher's `log` commands still running on that host (`dtf logs -f` reads there: it
    gets SIGHUP when dtf's SSH session closes, give it a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        readers = [p for p in lab.processes(host) if " log --dir " in p[1]]
        if not readers or time.monotonic() > deadline:
            return readers
        time.sleep(0.2)


def test_unreachable_host_is_reported_while_others_roll_back(lab, write_inventory, home):
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "unreachable", "workers": [w1], "workdir": "/tmp/dtf-nowhere"}])
    # Bounded by the connect timeout: a TCP retry loop would outlast dtf()'s timeout.
    r = dtf("up", "--connect-timeout", "3", str(inv), home=home, timeout=120, env=FAKE)
    assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", "unreachable: unreachable:", "unreachable")
    assert leftovers(lab) == {}
    assert not (home / "state" / "lab.json").exists()


def _listener(lab, host, port: int) -> subprocess.Popen:
    """A process listening on `port` inside that lab host (its namespace)."""
    h = lab.host(host)
    prefix = ["ip", "netns", "exec", h.netns] if h.netns else []
    code = (f"import socket,sys,time; s=socket.socket(); s.bind(('0.0.0.0',{port})); s.listen();"
            f"print('ok',flush=True); time.sleep(120)")
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ok"
    return proc


def test_port_taken_on_a_host(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    blocker = _listener(lab, "h1", w0)
    try:
        r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    finally:
        blocker.kill()
        blocker.wait()
    assert_one_line_error(r, 4, f"h1: port busy: {w0} (worker:0)")
    assert leftovers(lab) == {}


def test_wrong_identity_file_is_refused(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}],
                          identity_file=str(lab.wrong_key))
    r = dtf("up", str(inv), home=home, timeout=120)
    err = assert_one_line_error(r, 4, "dtf up failed on 2 host(s)", "authentication refused")
    assert str(lab.wrong_key) in err
    assert leftovers(lab) == {}


def test_tensorflow_version_mismatch_is_refused(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    fake = REPO / "tests" / "fakes" / "python-tf-mismatch"
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0], "python": str(fake)}])
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)  # the check reads the package metadata
    assert_one_line_error(r, 4, "h1: TensorFlow mismatch: 2.0.0 on the host", "2.21.0 on this machine")
    assert leftovers(lab) == {}


# One host: its check and start are one upload-and-run; two: hosts started in turns (a conversation).
@pytest.mark.parametrize("n_hosts", [1, 2])
def test_missing_python_is_reported(lab, write_inventory, home, n_hosts):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps], "python": "/nonexistent/bin/python3"},
                           {"host": "h1", "workers": [w0]}] if n_hosts == 2 else
                          [{"host": "h0", "ps": [ps], "workers": [w0], "python": "/nonexistent/bin/python3"}])
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    assert_one_line_error(r, 4, "h0: python missing: '/nonexistent/bin/python3'", "python: managed")
    assert "rollback failed" not in r.stderr  # the launcher it could not run is simply removed
    assert leftovers(lab) == {}


def test_a_host_never_reached_is_not_rolled_back(lab, write_inventory, home, tmp_path):
    # A name ssh cannot resolve (refused locally, without asking any name server).
    config = tmp_path / "ssh_config_unreached"
    config.write_text(f"Host nowhere\n  HostName {lab.hosts[0].address}\n  AddressFamily inet6\n\n"
                      f"Host *\n  Include {lab.ssh_config}\n")
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "nowhere", "workers": [w1], "workdir": "/tmp/dtf-nowhere"}])
    inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    err = assert_one_line_error(r, 4, "nowhere: unreachable: cannot resolve nowhere")
    assert "rollback failed" not in err
    assert not [line for line in err.splitlines() if line.startswith("  nowhere: uploading")], err
    assert [line for line in err.splitlines() if "cannot resolve" in line and "failed:" not in line] == [
        "  nowhere: unreachable: cannot resolve nowhere: Address family for hostname not supported"]
    assert leftovers(lab) == {}


def test_down_keeps_an_unreachable_host_for_a_retry(lab, write_inventory, home):
    if lab.mode != "netns":
        pytest.skip("cutting a host's link needs network namespaces (lab in loopback mode)")
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    assert dtf("up", str(inv), home=home, timeout=120, env=FAKE).returncode == 0
    lab.link_down("h1")
    try:
        r = dtf("down", "--connect-timeout", "3", home=home, timeout=120)
        assert_one_line_error(r, 4, "dtf down failed on 1 host(s)", "h1: unreachable",
                              "kept in the record: run `dtf down` again")
        assert lab.processes("h0") == [] and len(lab.processes("h1")) == 2
        record = json.loads((home / "state" / "lab.json").read_text())
        assert [h["spec"]["host"] for h in record["plan"]["hosts"]] == ["h1"]
    finally:
        lab.link_up("h1")
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "1 server(s) stopped on 1 host(s)" in r.stdout
    assert leftovers(lab) == {}


def test_ssh_config_alias_with_proxyjump(lab, write_inventory, home, tmp_path):
    """A host reached through a jump host, named by an ssh_config alias: HostName, User and
    ProxyJump come from ssh_config; the TF address is the alias's HostName."""
    if lab.mode != "netns":
        pytest.skip("a jump between hosts needs network namespaces (lab in loopback mode)")
    h2 = lab.host("h2")
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host behind-h0\n  HostName {h2.address}\n  User root\n  ProxyJump h0\n"
        f"  UserKnownHostsFile {lab.known_hosts}\n  StrictHostKeyChecking yes\n\n"
        f"Host h0\n  IdentityFile {lab.key}\n\n"
        + Path(lab.ssh_config).read_text())  # (paramiko's ssh_config has no Include)
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h1", "ps": [ps]},
                           {"host": "behind-h0", "workers": [w0], "workdir": h2.workdir}])
    inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    assert r.returncode == 0, r.stderr
    rows = status_json(home)["tasks"]
    assert [(x["task"], x["address"], x["state"]) for x in rows] == [
        ("ps:0", f"{lab.host('h1').address}:{ps}", "alive"), ("worker:0", f"{h2.address}:{w0}", "alive")]
    assert len(lab.processes("h2")) == 2 and lab.processes("h0") == []
    assert dtf("down", home=home, timeout=120).returncode == 0
    assert leftovers(lab) == {}


def test_unknown_host_key_is_refused(lab, write_inventory, home, tmp_path):
    """Host keys are checked like OpenSSH does (Fabric alone would accept any key)."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    config = tmp_path / "ssh_config"
    config.write_text(Path(lab.ssh_config).read_text().replace(str(lab.known_hosts), str(empty)))
    inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
    r = dtf("up", str(inv), home=home, timeout=120)
    assert_one_line_error(r, 4, "dtf up failed on 2 host(s)", "host key of root@", "is unknown")
    assert leftovers(lab) == {}


def test_hostile_workdir_is_never_executed(lab, write_inventory, home, tmp_path):
    """Values reach the remote shell quoted: a workdir carrying commands is only a path."""
    marker = tmp_path / "executed"
    h1 = lab.host("h1")
    workdir = f"{h1.workdir}/a b/$(touch {marker})/`touch {marker}`/'; touch {marker}; echo '"
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0], "workdir": workdir}])
    r = dtf("up", str(inv), home=home, timeout=120, env=FAKE)
    assert r.returncode == 0, r.stderr
    assert Path(workdir, "lab", "worker-0", "pid.json").exists()  # the literal path, as written
    assert dtf("status", home=home, timeout=60).returncode == 0
    assert dtf("logs", "worker:0", home=home, timeout=60).returncode == 0
    assert dtf("down", home=home, timeout=120).returncode == 0
    assert not marker.exists()
    assert not Path(workdir, "lab").exists()
