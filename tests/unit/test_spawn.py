"""The masters begun before dtf has loaded (dtf.hosts.spawn), against a stand-in `ssh` that
behaves as OpenSSH's for what dtf asks of it: `-G` (no jump host), a master (`-N -f`: the handshake,
then the control socket, then the parent exits) and `-O check` / `-O exit` at its socket. Each run
is counted in a log, so that what started which ssh is seen."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts import spawn
from dtf.hosts.masters import Master
from dtf.hosts.spawn import _wait_exited

FAKE_SSH = r'''
import os, socket, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_SSH_LOG"], "a") as f:
    f.write(" ".join(args) + "\n")
if "-G" in args:
    print("hostname login")
    sys.exit(0)
if "-O" in args:
    path, command = args[args.index("-S") + 1], args[args.index("-O") + 1]
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(command.encode())
            pid = s.recv(64).decode()
    except OSError:
        sys.exit(255)
    print(f"Master running (pid={pid})", file=sys.stderr)
    sys.exit(0)
path = [a.split("=", 1)[1] for a in args if a.startswith("ControlPath=")][0]
time.sleep(float(os.environ.get("FAKE_SSH_HANDSHAKE", "0")))
if os.environ.get("FAKE_SSH_REFUSE"):
    print("Permission denied (publickey).", file=sys.stderr)
    sys.exit(255)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
if os.fork():
    os._exit(0)  # -f: the parent goes once the master runs
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:
    conn, _ = server.accept()
    with conn:
        command = conn.recv(64)
        if command:
            conn.sendall(str(os.getpid()).encode())
        if command == b"exit":
            os.unlink(path)
            os._exit(0)
'''

SPEC = HostSpec(host="login", line=1, connection="ssh", user=None, port=None, identity_file=None,
                python="python3", workdir="~", address=None, ps_ports=(), worker_ports=())


@pytest.fixture
def ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in ssh; DTF_HOME in tmp_path. Its masters are ended after the test."""
    exe = tmp_path / "ssh"
    exe.write_text(f"#!{sys.executable}\n{FAKE_SSH}")
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(spawn, "_pending", {})
    monkeypatch.setattr(spawn, "_begun", set())
    monkeypatch.setattr(spawn, "_started", {})
    monkeypatch.setattr(spawn, "_for", None)
    yield exe
    for sock in (tmp_path / "ctl").glob("m*"):
        if not sock.name.endswith(".log"):
            Master(str(exe), SPEC, None, str(sock)).stop()


def runs(tmp_path: Path) -> list[str]:
    """The masters the stand-in started (not its -G, -O)."""
    log = tmp_path / "ssh.log"
    return [line for line in log.read_text().splitlines() if "-N -f" in line] if log.exists() else []


def master(ssh: Path, tmp_path: Path, timeout: float = 10, name: str = "m1") -> Master:
    return Master(str(ssh), SPEC, None, str(tmp_path / "ctl" / name), connect_timeout=timeout, session=False)


def remembered(ssh: Path, tmp_path: Path, inv: Path, **given: float | None) -> Master:
    """An `up`'s master, started and remembered for `inv` (as dtf.entry has it done at the end of an
    `up`), then closed (`down`)."""
    spawn.begin(str(inv), given.get("timeout"), given.get("ttl"))  # (nothing remembered yet: begins none)
    m = master(ssh, tmp_path)
    m.start()
    assert m.argv is not None
    spawn.keep()
    m.stop()
    assert not spawn.listening(m.path)
    spawn._started.clear()
    return m


def hosts_up(ssh: Path, tmp_path: Path, inv: Path) -> list[Master]:
    """An `up` of three hosts of a new inventory `inv`: their masters started and remembered (as
    dtf.entry has it done at the command's end), and still running."""
    inv.write_text("cluster: c\n")
    spawn.begin(str(inv), None, None)
    masters = [master(ssh, tmp_path, name=f"m{i}") for i in range(3)]
    for m in masters:
        m.start()
    spawn.keep()
    spawn._started.clear()
    return masters


def test_the_next_up_of_an_unchanged_inventory_begins_the_same_master_and_its_master_takes_it(
        ssh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    m = remembered(ssh, tmp_path, inv)
    monkeypatch.setenv("FAKE_SSH_HANDSHAKE", "0.3")
    spawn.begin(str(inv), None, None)
    assert spawn.pending(m.path) and spawn.begun(m.path)
    again = master(ssh, tmp_path)
    again.start()  # takes the early ssh over: waits for its handshake, starts none of its own
    assert len(runs(tmp_path)) == 2 and spawn.listening(m.path) and not spawn.pending(m.path)
    spawn.abandon()  # the command's end: the master was taken, it stays
    assert spawn.listening(m.path)
    cache = json.loads((tmp_path / "home" / spawn.CACHE).read_text())
    assert cache[os.path.realpath(inv)]["masters"] == [[again.argv, again.path]]


def test_every_host_master_an_up_started_is_begun_by_the_next_in_order_at_most_turns_of_them(
        ssh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An `up` of SSH hosts starts one master per host: the next `up` begins them all (the first
    DTF_TURNS: the hosts it starts at once), and each host's master takes its own."""
    inv = tmp_path / "inv.yaml"
    first = hosts_up(ssh, tmp_path, inv)
    for m in first:
        m.stop()
    cache = json.loads((tmp_path / "home" / spawn.CACHE).read_text())
    assert [path for _, path in cache[os.path.realpath(inv)]["masters"]] == [m.path for m in first]

    monkeypatch.setenv("DTF_TURNS", "2")
    spawn.begin(str(inv), None, None)
    assert [spawn.pending(m.path) for m in first] == [True, True, False]
    again = [master(ssh, tmp_path, name=f"m{i}") for i in range(3)]
    for m in again:
        m.start()
    assert len(runs(tmp_path)) == 6 and not spawn._pending  # 3 by the first `up`, 2 early, 1 of its own
    assert all(spawn.listening(m.path) for m in again)


def test_a_master_through_a_jump_hosts_master_is_not_begun_early(ssh: Path, tmp_path: Path) -> None:
    """It would find the jump host's master not there yet: only the jump host's own is."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    spawn.begin(str(inv), None, None)
    hop = master(ssh, tmp_path, name="m-hop")
    behind = Master(str(ssh), SPEC, None, str(tmp_path / "ctl" / "m-behind"), session=False, through=hop)
    hop.start()
    behind.start()
    assert behind.argv is not None and spawn._started == {hop.path: hop.argv}


def test_the_cache_of_an_older_dtf_is_removed_and_an_entry_of_its_shape_begins_nothing(
        ssh: Path, tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    home = tmp_path / "home"
    home.mkdir()
    st = os.stat(inv)
    old = {os.path.realpath(inv): {"stat": [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev],
                                   "connect_timeout": None, "ttl": None, "argv": [str(ssh)], "path": "x"}}
    (home / spawn.OLD_CACHE).write_text(json.dumps(old))
    (home / spawn.CACHE).write_text(json.dumps(old))
    spawn.begin(str(inv), None, None)
    assert not spawn._pending
    master(ssh, tmp_path).start()
    spawn.keep()
    assert not (home / spawn.OLD_CACHE).exists()
    assert "masters" in json.loads((home / spawn.CACHE).read_text())[os.path.realpath(inv)]


@pytest.mark.parametrize("change", ["inventory", "timeout", "ttl", "running"])
def test_nothing_begins_early_for_a_changed_inventory_other_options_or_a_running_master(
        ssh: Path, tmp_path: Path, change: str) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    m = remembered(ssh, tmp_path, inv, timeout=7, ttl=600)
    given = {"timeout": 7.0, "ttl": 600.0}
    if change == "inventory":
        inv.write_text("cluster: d\n")
    elif change == "running":
        master(ssh, tmp_path).start()
    else:
        given[change] = None
    spawn.begin(str(inv), given["timeout"], given["ttl"])
    assert not spawn.pending(m.path) and not spawn.begun(m.path)


def test_an_early_master_that_is_not_the_one_up_would_start_is_ended_first(
        ssh: Path, tmp_path: Path) -> None:
    """dtf's options changed since (here: ConnectTimeout): the early master is closed, and `up`'s
    own started; one master answers, the right one."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    m = remembered(ssh, tmp_path, inv)
    spawn.begin(str(inv), None, None)
    early = spawn._pending[m.path][1]
    early.wait(timeout=10)  # its master runs
    early_master = master(ssh, tmp_path).pid()
    assert early_master is not None
    other = master(ssh, tmp_path, timeout=33)
    other.start()
    assert len(runs(tmp_path)) == 3 and "ConnectTimeout=33" in runs(tmp_path)[-1]
    assert other.pid() not in (None, early_master)
    assert _wait_exited(early_master, 5)
    assert spawn.listening(m.path) and not spawn.pending(m.path)
    assert "ConnectTimeout=33" in " ".join(other.argv or [])


@pytest.mark.parametrize("handshake", [0.0, 5.0])
def test_an_early_master_no_up_took_is_ended_at_the_commands_end(
        ssh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handshake: float) -> None:
    """Whether its handshake is over (a master runs: closed) or not (the ssh is killed): nothing is
    left, neither process nor socket nor log."""
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    m = remembered(ssh, tmp_path, inv)
    monkeypatch.setenv("FAKE_SSH_HANDSHAKE", str(handshake))
    spawn.begin(str(inv), None, None)
    early = spawn._pending[m.path][1]
    if not handshake:
        early.wait(timeout=10)
        assert spawn.listening(m.path)
    t0 = time.monotonic()
    spawn.abandon()
    assert time.monotonic() - t0 < 3
    assert early.poll() is not None and not spawn.listening(m.path)
    assert not Path(m.path).exists() and not Path(m.path + ".log").exists()


def test_a_failed_early_handshake_is_the_masters_failure(
        ssh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The early ssh's own failure is what `up` reports, with ssh's words (no second try)."""
    from dtf.hosts.masters import MasterFailed

    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\n")
    remembered(ssh, tmp_path, inv)
    monkeypatch.setenv("FAKE_SSH_REFUSE", "1")
    spawn.begin(str(inv), None, None)
    with pytest.raises(MasterFailed) as info:
        master(ssh, tmp_path).start()
    assert "Permission denied" in info.value.log and len(runs(tmp_path)) == 2


def test_the_cache_is_under_dtf_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dtf.cluster import state

    monkeypatch.setenv("DTF_HOME", str(tmp_path / "h"))
    assert Path(spawn.cache_path()) == state.home() / spawn.CACHE
    monkeypatch.delenv("DTF_HOME")
    assert Path(spawn.cache_path()) == state.home() / spawn.CACHE


def test_a_repair_that_starts_one_master_keeps_the_others_remembered(ssh: Path, tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    first = hosts_up(ssh, tmp_path, inv)
    first[1].stop()  # its master went; the others still run (the cluster is up)
    spawn.begin(str(inv), None, None)
    assert list(spawn._pending) == [first[1].path]
    master(ssh, tmp_path, name="m1").start()
    spawn.keep()
    cache = json.loads((tmp_path / "home" / spawn.CACHE).read_text())
    assert [path for _, path in cache[os.path.realpath(inv)]["masters"]] == [m.path for m in first]
