"""The host protocol, typed once: replies round-trip, another version is refused, the launcher
ships as one deterministic zipapp, uploads are atomic."""

from __future__ import annotations

import dataclasses
import errno
import json
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.files import shipping
from dtf.hosts.local import LocalRunner
from dtf.hosts.netutil import free_ports, listen_ports
from dtf_server import protocol
from dtf_server.protocol import (
    PROTOCOL,
    CheckReply,
    CleanReply,
    EnvReply,
    Lease,
    ProtocolMismatch,
    PurgeReply,
    RenewReply,
    StartReply,
    StatusReply,
    StopReply,
    TaskSpec,
    TaskStarted,
    TaskStatus,
    TaskStopped,
)
from helpers import within

REPLIES = [
    CheckReply(python="3.11.2", executable="/usr/bin/python3", tensorflow="2.21.0", busy=[2222],
               client_address="10.0.0.1", running=["ps:0"]),
    StartReply(tasks={"ps:0": TaskStarted(ok=True, pid=41), "worker:0": TaskStarted(
        ok=False, pid=42, reason="server exited with code 1", log_tail=["boom"])}),
    StartReply(tasks={"ps:0": TaskStarted(ok=True, pid=41)}, unreachable={"10.0.0.2:2222": "Connection refused"}),
    StartReply(tasks={"ps:0": TaskStarted(ok=True, pid=41)}, unreachable={}),
    StatusReply(tasks={"ps:0": TaskStatus(alive=True, phase="running", pid=41, server_pid=43, uptime=1.5,
                                          serving=True, restarts=2, last_exit="killed by SIGKILL")},
                lease=Lease(ttl=60.0, renewed=1700000000.5)),
    StatusReply(tasks={"worker:0": TaskStatus.dead("never started")}, lease=None),
    RenewReply(lease=None),
    StopReply(tasks={"ps:0": TaskStopped(was_running=True, killed=True, gone=True)}),
    StopReply(tasks={"ps:0": TaskStopped(was_running=True)}, cleaned=CleanReply(removed=["/x/ps-0"])),
    CleanReply(removed=["/x/ps-0/log"], in_use=False),
    CheckReply(python="3.11.2", executable="/usr/bin/python3", tensorflow=None, busy=[], client_address=None,
               running=[], machine="x86_64", system="Linux", libc="glibc 2.36", env_ready=False,
               wheels=["tf_keras-2.21.0-py3-none-any.whl"], free=10**9, gpus=4),
    EnvReply(ok=True, seconds={"create": 0.1, "install": 20.5}, size=1500000000),
    EnvReply(ok=False, error="disk full while building the environment in /srv/e"),
    PurgeReply(removed=["/w/.cache/env"], size=10**9),
]


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_every_reply_round_trips(reply: protocol.Reply):
    text = "some noise a library printed\n" + protocol.encode(reply) + "\n"
    assert json.loads(protocol.encode(reply))["protocol"] == PROTOCOL
    assert protocol.decode(type(reply), text) == reply


def test_another_protocol_is_refused_never_misread():
    data = json.loads(protocol.encode(REPLIES[0]))
    data["protocol"] = PROTOCOL + 1
    with pytest.raises(ProtocolMismatch, match=f"speaks protocol {PROTOCOL + 1}"):
        protocol.decode(CheckReply, json.dumps(data))
    old = {"tasks": {}, "lease": None}  # a launcher from before the protocol had a version
    with pytest.raises(ProtocolMismatch):
        protocol.decode(StatusReply, json.dumps(old))
    for bad in ("", "not json at all", json.dumps([1, 2]), json.dumps({"protocol": PROTOCOL})):
        with pytest.raises(ValueError):
            protocol.decode(StatusReply, bad)


def test_a_task_state_is_decided_once():
    alive = TaskStatus(alive=True, phase="running", pid=1, server_pid=2, uptime=1.0, serving=True)
    assert alive.state == "alive"
    assert TaskStatus(alive=True, phase="restarting", pid=1, server_pid=None, uptime=None, serving=False).state \
        == "restarting"
    assert TaskStatus(alive=True, phase="failed", pid=1, server_pid=None, uptime=None, serving=False).state \
        == "failed"
    assert TaskStatus.dead("supervisor is gone").state == "dead"


def test_task_spec_round_trips():
    spec = TaskSpec(job="worker", index=3, port=2225, argv=["python3", "~/x y/l.pyz", "serve", "--job", "worker"])
    assert TaskSpec.from_arg(spec.to_arg()) == spec


@pytest.fixture
def own_launcher_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A launcher cache of the test's own, and this process's launcher built anew in it; after
    the test, built anew again from the laptop's cache, where every dtf process reads it (a
    later test of this process names the launcher the way the dtf commands it runs do)."""
    from dtf.files.environment import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    cached = (shipping.launcher_bytes, shipping.launcher_name, shipping.helpers_bytes, shipping.helpers_name)
    for function in cached:
        function.cache_clear()
    yield tmp_path / "cache"
    for function in cached:
        function.cache_clear()


def test_the_first_launcher_build_in_the_cache_is_every_processs(own_launcher_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """Another process's build lands in the cache while this one builds: this one ships that
    file's bytes (and so names the same launcher), and leaves the file as it found it."""
    build = shipping._build
    ours = shipping.launcher_bytes()  # built, and written to the cache
    (cached,) = (own_launcher_cache / "launchers").glob("*.pyz")
    assert cached.read_bytes() == ours
    theirs = b"PK another process's build"
    cached.write_bytes(theirs)
    cached.rename(cached.with_name("keep"))

    def another_first(server: list[tuple[str, bytes]]) -> bytes:
        cached.with_name("keep").rename(cached)  # lands while this process builds
        return build(server)

    shipping.launcher_bytes.cache_clear()
    monkeypatch.setattr(shipping, "_build", another_first)
    assert shipping.launcher_bytes() == theirs and cached.read_bytes() == theirs
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temporary file left


def test_the_launcher_is_one_deterministic_zipapp_named_by_its_content(own_launcher_cache: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    # Built here, in a cache of the test's own, twice in this process: the same bytes. (Another
    # process's build may differ: its bytecode's marshal refs and frozenset orders are its own;
    # see shipping.launcher_bytes.)
    from dtf.files.environment import CACHE_ENV

    data = shipping.launcher_bytes()
    names = zipfile.ZipFile(BytesIO(data)).namelist()
    assert names[-1] == "__main__.py" and "dtf_server/protocol.py" in names and "dtf_server/commands.py" in names
    assert not [n for n in names if n.startswith("dtf/")]  # dtf's own package is a zip of its own
    assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zipfile.ZipFile(BytesIO(data)).infolist())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache-b"))
    shipping.launcher_bytes.cache_clear()
    assert shipping.launcher_bytes() == data  # built again: the same bytes, the same name
    assert (tmp_path / "cache-b").exists()
    assert shipping.launcher_name().startswith("launcher-") and shipping.launcher_name().endswith(".pyz")
    # It runs with a bare python (no dtf installed): the check command answers in the protocol.
    path = tmp_path / shipping.launcher_name()
    path.write_bytes(data)
    r = subprocess.run(["/usr/bin/env", "-i", sys.executable, "-S", str(path), "check", "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert protocol.decode(CheckReply, r.stdout).python == sys.version.split()[0]


def test_the_launcher_runs_its_bytecode_and_a_python_of_another_version_its_source(tmp_path: Path):
    path = tmp_path / shipping.launcher_name()
    path.write_bytes(shipping.launcher_bytes())
    where = "import sys; sys.path.insert(0, sys.argv[1]); from dtf_server import commands; print(commands.main.__code__.co_filename)"
    r = subprocess.run([sys.executable, "-S", "-c", where, str(path)], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "dtf_server/commands.py", r.stderr  # the pyc's (from source: the zip's path)
    # Another python's magic number: its zipimport ignores the pyc and compiles the source.
    old = tmp_path / "old.pyz"
    with zipfile.ZipFile(BytesIO(shipping.launcher_bytes())) as src, zipfile.ZipFile(old, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"\0\0\r\n" + data[4:] if info.filename.endswith(".pyc") else data)
    r = subprocess.run([sys.executable, "-S", "-c", where, str(old)], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == f"{old}/dtf_server/commands.py", r.stderr
    r = subprocess.run([sys.executable, "-S", str(old), "check", "--port", "1"], capture_output=True, text=True,
                       timeout=60)
    assert protocol.decode(CheckReply, r.stdout).python == sys.version.split()[0]


def test_check_start_starts_only_a_host_that_passes_its_check(tmp_path: Path):
    """`up`'s check and start in one launcher call: the CheckReply line, then (only when the host
    passes it) the StartReply; a busy port or another TensorFlow starts nothing."""
    path = tmp_path / shipping.launcher_name()
    path.write_bytes(shipping.launcher_bytes())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = free_ports(1)[0]
        root = tmp_path / "cluster"

        def check_start(task_port: int, tensorflow: str) -> list[str]:
            task = protocol.TaskSpec("worker", 0, task_port, [sys.executable, str(path), "fake", "--job", "worker",
                                     "--index", "0", "--port", str(task_port), "--ready",
                                     str(root / "worker-0" / "ready.json")])
            r = subprocess.run([sys.executable, str(path), "check-start", "--dir", str(root), "--port", str(task_port),
                                "--tensorflow", tensorflow, "--fresh", "--timeout", "30", "--ttl", "60",
                                "--task", task.to_arg()], capture_output=True, text=True, timeout=60)
            return r.stdout.strip().splitlines()

        lines = check_start(port, "")
        assert len(lines) == 1 and protocol.decode(CheckReply, lines[0]).busy == [port]
        lines = check_start(free, "0.0.1")
        assert len(lines) == 1 and not (root / "worker-0").exists()
        lines = check_start(free, "")
        assert len(lines) == 2, lines
        assert protocol.decode(CheckReply, lines[0]).busy == []
        started = protocol.decode(protocol.StartReply, lines[1])
        assert started.ok, started
        stopped = subprocess.run([sys.executable, str(path), "stop", "--dir", str(root), "--grace", "5", "--task",
                                  "worker:0"], capture_output=True, text=True, timeout=60)
        assert protocol.decode(protocol.StopReply, stopped.stdout).tasks["worker:0"].gone, stopped.stdout


def test_the_mesh_check_in_a_start_waits_for_a_server_still_starting_and_names_what_it_never_reached():
    """`start --reach` (dtf_server.network.reach, again=True): the other hosts' servers may
    still be starting: a port that listens only later is reached; one that never listens is
    named, with the last reason, once its time is up. Without `again`, one try each."""
    from dtf_server.network import reach

    late, never = listen_ports(2, "127.0.0.1")
    server = socket.socket()
    refused = threading.Event()

    def listen_later() -> None:
        refused.wait(30)  # after the first look found nothing there
        time.sleep(0.3)
        server.bind(("127.0.0.1", late))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        assert reach([f"127.0.0.1:{late}"], 3.0) == {f"127.0.0.1:{late}": "Connection refused"}
        refused.set()
        assert reach([f"127.0.0.1:{late}", f"127.0.0.1:{never}"], 3.0, again=True) == {
            f"127.0.0.1:{never}": "Connection refused"}
    finally:
        refused.set()
        thread.join()
        server.close()


def test_a_refused_target_is_named_so_when_a_loaded_host_oversleeps_its_time(monkeypatch: pytest.MonkeyPatch):
    """On a loaded host a try can outlast the time left: the target is still named with its last
    reason (refused), not "no answer"."""
    from dtf_server import network

    (never,) = listen_ports(1, "127.0.0.1")
    real_connect = network.connect

    def slow(sock: socket.socket, address: tuple[str, int]) -> int:
        time.sleep(0.5)
        return real_connect(sock, address)

    monkeypatch.setattr(network, "connect", slow)
    assert network.reach([f"127.0.0.1:{never}"], 0.3, again=True) == {f"127.0.0.1:{never}": "Connection refused"}


def test_a_target_that_never_answers_is_named_once_its_time_is_up():
    """A listener whose queue is full drops the SYNs (as a firewall that drops them would): the
    check gives up at its deadline, names it so, and still reports the target that answered."""
    from dtf_server.network import reach

    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # until a connection is not answered: the queue is full
            c = socket.socket()
            c.settimeout(0.2)
            fillers.append(c)
            try:
                c.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.fail("the listen queue never filled")
        (answering,) = listen_ports(1, "127.0.0.1")
        with socket.create_server(("127.0.0.1", answering)):
            # (a connect left to the kernel's SYN retries would take minutes)
            assert within(60, lambda: reach([f"127.0.0.1:{port}", f"127.0.0.1:{answering}"], 0.5, again=True)) == {
                f"127.0.0.1:{port}": "no answer within 0.5s"}
    finally:
        for c in fillers:
            c.close()
        full.close()


def test_the_mesh_check_tries_many_refusing_targets_at_a_bounded_rate(monkeypatch: pytest.MonkeyPatch):
    """While the other hosts start, each refusing target is tried every len(targets) / REACH_RATE
    seconds (at least every REACH_PAUSE): every host checks every other host's tasks at once. An
    upper bound only: a slow machine tries less often, never more."""
    from dtf_server import network

    tries: list[str] = []

    def refuse(sock: socket.socket, address: tuple[str, int]) -> int:
        tries.append(f"{address[0]}:{address[1]}")
        return errno.ECONNREFUSED

    monkeypatch.setattr(network, "connect", refuse)
    targets = [f"10.0.0.{i}:2222" for i in range(40)]
    seconds = 1.0
    missed = network.reach(targets, seconds, again=True)
    assert missed == dict.fromkeys(targets, "Connection refused")
    pause = max(network.REACH_PAUSE, len(targets) / network.REACH_RATE)  # 0.4 s
    assert len(tries) <= len(targets) * (seconds / pause + 1), len(tries)  # (3 each)
    assert min(tries.count(t) for t in targets) >= 1


def test_a_missing_launcher_is_python_exit_2_with_no_reply(tmp_path: Path):
    r = subprocess.run([sys.executable, str(tmp_path / "launcher-000000000000.pyz"), "status"],
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (protocol.EXIT_NO_LAUNCHER, "")
    # The launcher itself never exits 2: a command line it does not understand is 64.
    path = tmp_path / shipping.launcher_name()
    path.write_bytes(shipping.launcher_bytes())
    r = subprocess.run([sys.executable, str(path), "status", "--no-such-option"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == protocol.EXIT_USAGE and "launcher status: error:" in r.stderr


def test_uploads_are_atomic_and_leave_no_temporary_file(tmp_path: Path):
    t = LocalRunner(HostSpec(host="localhost", line=1, connection="local", user=None, port=None,
                                identity_file=None, python="python3", workdir=str(tmp_path), address=None,
                                ps_ports=(), worker_ports=()))
    target = tmp_path / "root"
    t.put_bytes(b"first", str(target), "launcher-x.pyz")
    t.put_bytes(b"second", str(target), "launcher-x.pyz")
    assert [p.name for p in target.iterdir()] == ["launcher-x.pyz"]
    assert (target / "launcher-x.pyz").read_bytes() == b"second"


def test_listen_port_is_free_and_below_the_outgoing_connections_range(monkeypatch) -> None:
    """The coordinator's port: a connect() made while TensorFlow is imported never takes it."""
    from dtf.hosts import netutil

    low = netutil._ephemeral_low()
    for _ in range(20):
        port = netutil.listen_port()
        if low - netutil.LISTEN_LOW >= 1000:
            assert netutil.LISTEN_LOW <= port < low
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free now
    ports = netutil.listen_ports(5)  # a local cluster's: distinct, and each picked the same way
    assert len(set(ports)) == 5
    if low - netutil.LISTEN_LOW >= 1000:
        assert all(netutil.LISTEN_LOW <= port < low for port in ports)
    # No room below the range: any free port, as bind(0) gives.
    monkeypatch.setattr(netutil, "_ephemeral_low", lambda: netutil.LISTEN_LOW + 10)
    with socket.socket() as s:
        s.bind(("0.0.0.0", netutil.listen_port()))
    assert len(set(netutil.listen_ports(3))) == 3


def test_records_behave_as_frozen_dataclasses():
    """The replies are frozen dataclasses: constructor, defaults, equality, hash, repr and
    immutability, and asdict as encode writes them."""
    a, b = TaskStopped(True), TaskStopped(was_running=True, killed=False, gone=True)
    assert a == b and hash(a) == hash(b) and a != TaskStopped(False) and a != (True, False, True)
    assert repr(a) == "TaskStopped(was_running=True, killed=False, gone=True)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.killed = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del a.gone  # type: ignore[misc]
    x = CheckReply(python="3", executable="p", tensorflow=None, busy=[], client_address=None, running=[])
    y = CheckReply(python="3", executable="p", tensorflow=None, busy=[], client_address=None, running=[])
    assert x.wheels == [] and x.wheels is not y.wheels and x.free == -1  # a fresh list per record
    for bad in ({"was_running": True, "bogus": 1}, {"killed": True}):
        with pytest.raises(TypeError):
            TaskStopped(**bad)
    with pytest.raises(TypeError):
        TaskStopped(True, was_running=True)  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(TaskStopped)] == ["was_running", "killed", "gone"]
    nested = StopReply(tasks={"ps:0": a}, cleaned=CleanReply(removed=["x"]))
    assert dataclasses.asdict(nested) == {"tasks": {"ps:0": {"was_running": True, "killed": False, "gone": True}},
                                        "cleaned": {"removed": ["x"], "in_use": False}}


def test_tf_version_is_read_from_the_dist_info_names_on_sys_path(tmp_path, monkeypatch):
    """As importlib.metadata: the first of tensorflow, tensorflow-cpu; for it, the first entry of
    sys.path that has it; another package's dist-info is not TensorFlow's."""
    from importlib import metadata

    from dtf_server.protocol import tf_version

    first, second = tmp_path / "a", tmp_path / "b"
    for d, names in ((first, ["tensorflow_cpu-2.20.0.dist-info", "tensorflow_io_gcs_filesystem-0.37.1.dist-info"]),
                     (second, ["TensorFlow-2.19.1.dist-info", "tensorflow_cpu-2.18.0.dist-info"])):
        for n in names:
            (d / n).mkdir(parents=True)
            name, _, version = n.removesuffix(".dist-info").partition("-")
            (d / n / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(first), str(second)])
    assert tf_version() == metadata.version("tensorflow") == "2.19.1"
    monkeypatch.setattr(sys, "path", [str(first)])
    assert tf_version() == metadata.version("tensorflow-cpu") == "2.20.0"
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing")])
    assert tf_version() is None


def test_a_host_passes_its_check_with_the_gpus_it_is_given_or_without_a_driver():
    from dtf_server.start import check_passes

    def host(gpus: int | None) -> CheckReply:
        return CheckReply(python="3", executable="p", tensorflow="2.21.0", busy=[], client_address=None,
                          running=[], gpus=gpus)

    assert check_passes(host(2), "2.21.0", True, gpus=2) and check_passes(host(8), "2.21.0", True, gpus=2)
    assert not check_passes(host(1), "2.21.0", True, gpus=2) and not check_passes(host(0), "", False, gpus=1)
    assert check_passes(host(None), "2.21.0", True, gpus=2)  # no NVIDIA driver: TensorFlow's CPU
    assert check_passes(host(0), "2.21.0", True)  # no gpus key


def test_the_hosts_gpus_are_the_nvidia_drivers_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from dtf_server.procs import nvidia_gpus

    monkeypatch.setenv("DTF_NVIDIA_GPUS_DIR", str(tmp_path / "none"))
    assert nvidia_gpus() is None
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setenv("DTF_NVIDIA_GPUS_DIR", str(tmp_path))
    assert nvidia_gpus() == 2


def test_the_hosts_platform_is_what_the_platform_module_says():
    """The check's machine, system and libc come from os (procs.platform_info), and say what
    platform.machine(), system() and libc_ver() say."""
    import platform

    from dtf_server.procs import platform_info

    libc, version = platform.libc_ver()
    assert platform_info() == (platform.machine(), platform.system(), f"{libc} {version}" if libc and version else "")


def test_dtfs_own_package_ships_as_a_zip_beside_the_launcher_for_collective_copies(
        own_launcher_cache: Path, tmp_path: Path):
    """What a collective copy imports on a host (`python -m dtf.program.runner`, `import dtf`):
    a zip named by its content, built once into the cache; with it and the launcher on
    PYTHONPATH, as a copy's supervisor puts them, a bare python (no dtf installed) imports the
    runner."""
    data = shipping.helpers_bytes()
    names = zipfile.ZipFile(BytesIO(data)).namelist()
    assert "dtf/program/runner.py" in names and "dtf/__init__.py" in names
    assert not [n for n in names if n.startswith("dtf_server/")]
    assert [p.suffix for p in (own_launcher_cache / "launchers").iterdir()] == [".zip"]
    name = shipping.helpers_name()
    assert name.startswith("dtf-") and name.endswith(".zip") and protocol.Layout.is_helpers(name)
    path, launcher = tmp_path / name, tmp_path / shipping.launcher_name()
    path.write_bytes(data)
    launcher.write_bytes(shipping.launcher_bytes())
    r = subprocess.run(["/usr/bin/env", "-i", f"PYTHONPATH={path}:{launcher}", sys.executable, "-S", "-c",
                        "import dtf.program.runner, dtf; print(dtf.__file__)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().startswith(str(path)), r.stderr
