"""A supervisor runs its server in a fork of itself where the server's command is its own
launcher's `serve` or `fake` on its own python (dtf_server.start.in_process, supervisor.fork_server):
the real launcher, started as `up` starts it, with fake servers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dtf.files import shipping
from dtf.hosts.netutil import listen_ports
from dtf_server import protocol, start
from dtf_server.protocol import TaskSpec


def _launcher(tmp_path: Path) -> Path:
    path = tmp_path / shipping.launcher_name()
    path.write_bytes(shipping.launcher_bytes())
    return path


def test_only_this_launchers_server_commands_on_this_python_run_in_a_fork(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path):
    launcher = str(_launcher(tmp_path))
    monkeypatch.setattr(sys, "argv", [launcher, "start"])
    fake = [launcher, "fake", "--job", "ps", "--index", "0", "--port", "1", "--ready", "r.json"]
    forked = start.in_process([sys.executable, *fake])
    assert forked is not None and forked[1] == "fake"
    # The python found on the PATH, as exec would find it.
    monkeypatch.setenv("PATH", f"/nonexistent:{os.path.dirname(sys.executable)}")
    assert start.in_process([os.path.basename(sys.executable), *fake]) is not None
    # Anything else is a process of its own: another python (a managed environment's: another
    # interpreter, other packages), another launcher, another command, no command, and a command
    # with `gpus`' variables before it (dtf.cluster.gpus.env_prefix: in its /proc/PID/environ).
    assert start.in_process(["env", "CUDA_VISIBLE_DEVICES=0", sys.executable, *fake]) is None
    other = tmp_path / "python3"
    other.symlink_to(sys.executable)
    assert start.in_process([str(other), *fake]) is None
    assert start.in_process([sys.executable, str(tmp_path / "launcher-000000000000.pyz"), *fake[1:]]) is None
    assert start.in_process([sys.executable, launcher, "supervise-program", "--dir", "d"]) is None
    assert start.in_process([sys.executable, "-S", *fake]) is None
    assert start.in_process(["env", "A=1"]) is None
    assert start.in_process([]) is None


def _proc(pid: int, what: str) -> bytes:
    return Path(f"/proc/{pid}/{what}").read_bytes()


def _supervisor(root: Path) -> dict:
    return json.loads((root / "worker-0" / "supervisor.json").read_text())


def _wait(check, what: str, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not {what} after {timeout:g}s")


@pytest.mark.parametrize("own_python", [True, False], ids=["forked", "own-process"])  # own_python: the launcher's
def test_a_server_is_forked_from_its_supervisor_and_restarted_and_stopped_as_a_process_of_its_own(
        tmp_path: Path, own_python: bool):
    """The server forked from its supervisor is what a process of its own would be: its variables,
    its directory, stdin from /dev/null, its lines in the task's log, its exit code seen by the
    supervisor (which restarts it), gone with `stop`. With another python (here a link to the same
    one, under another name) the server is a process of its own, run by that python (not forked)."""
    launcher = _launcher(tmp_path)
    python = sys.executable
    if not own_python:
        python = str(tmp_path / "other-python")
        os.symlink(sys.executable, python)
    root = tmp_path / "cluster"
    tdir = root / "worker-0"
    (port,) = listen_ports(1)
    variables = [] if own_python else ["env", "DTF_TEST_VARIABLE=set"]  # (variables: a process of its own)
    task = TaskSpec("worker", 0, port, [*variables, python, str(launcher), "fake", "--job",
                                        "worker", "--index", "0", "--port", str(port), "--ready",
                                        str(tdir / "ready.json")])
    r = subprocess.run([sys.executable, str(launcher), "start", "--dir", str(root), "--timeout", "30", "--ttl", "60",
                        "--restart-backoff", "0.1", "--env", "PYTHONUNBUFFERED=1", "--task", task.to_arg()],
                       capture_output=True, text=True, timeout=60)
    started = protocol.decode(protocol.StartReply, r.stdout)
    assert started.ok, (r.stdout, r.stderr)
    supervisor = started.tasks["worker:0"].pid
    assert supervisor is not None
    try:
        server = _supervisor(root)["server_pid"]
        assert _proc(server, "stat").decode().rsplit(")", 1)[1].split()[1] == str(supervisor)  # its parent
        cmdline = _proc(server, "cmdline").split(b"\0")
        # Forked: the supervisor's command line (the launcher's `start`), and a name of its own;
        # else the server's own command line.
        assert (b"fake" not in cmdline and b"start" in cmdline) if own_python else (b"fake" in cmdline)
        if own_python:
            assert _proc(server, "comm").decode().strip() == "fake worker:0"
            assert _proc(supervisor, "comm").decode().strip() == "dtf worker:0"
        if not own_python:
            assert b"DTF_TEST_VARIABLE=set" in _proc(server, "environ").split(b"\0")
        assert os.readlink(f"/proc/{server}/cwd") == str(tdir)
        assert os.readlink(f"/proc/{server}/fd/0") == os.devnull
        assert sorted(int(fd) for fd in os.listdir(f"/proc/{server}/fd"))[:3] == [0, 1, 2]
        assert f"worker:0 (fake) serving on port {port}" in (tdir / "log").read_text()

        (tdir / "crash").touch()  # the fake server exits with code 3, its supervisor starts it again
        _wait(lambda: _supervisor(root)["last_exit"] == "exited with code 3", "seen exiting")
        (tdir / "crash").unlink()
        _wait(lambda: (s := _supervisor(root))["state"] == "running" and s["server_pid"] not in (None, server)
              and (tdir / "ready.json").exists(), "restarted")
        assert _supervisor(root)["restarts"] >= 1
    finally:
        stopped = subprocess.run([sys.executable, str(launcher), "stop", "--dir", str(root), "--grace", "5",
                                  "--task", "worker:0"], capture_output=True, text=True, timeout=60)
    assert protocol.decode(protocol.StopReply, stopped.stdout).tasks["worker:0"].gone, stopped.stdout
    for pid in (supervisor, _supervisor(root).get("server_pid") or server):
        assert not Path(f"/proc/{pid}").exists() or _proc(pid, "stat").decode().rsplit(")", 1)[1].split()[0] == "Z"


def _forked(tmp_path: Path, run) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """fork_server from this process, its output in a file: (its exit code as the supervisor sees it, the output)."""
    from dtf_server.supervisor import fork_server

    log = tmp_path / "log"
    saved = [os.dup(1), os.dup(2)]
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            server = fork_server(["python", "launcher", "fake"], run, str(tmp_path), "fake ps:0")
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    code = server.wait()
    assert server.poll() == code and server.returncode == code
    return code, log.read_text()


def test_a_forked_servers_directory_argv_output_and_exit_are_a_processes_own(tmp_path: Path):
    """What the server's code finds and how its end is seen: its directory, its argv, its lines in
    the log, and its exit as python would make it (sys.exit's code, an exception's 1 and traceback)."""

    def looks() -> int:
        print("argv", sys.argv, "cwd", os.getcwd())
        return 0

    code, out = _forked(tmp_path, looks)
    assert code == 0, out
    assert f"argv ['launcher', 'fake'] cwd {tmp_path}" in out

    def exits() -> int:
        sys.exit(3)

    assert _forked(tmp_path, exits)[0] == 3

    def fails() -> int:
        raise RuntimeError("the server broke")

    code, out = _forked(tmp_path, fails)
    assert code == 1 and "RuntimeError: the server broke" in out and "Traceback" in out

    def says() -> int:
        sys.exit("cannot serve")

    code, out = _forked(tmp_path, says)
    assert code == 1 and "cannot serve" in out


def test_a_forked_server_killed_is_seen_killed(tmp_path: Path):
    import signal

    from dtf_server.supervisor import exited, fork_server

    server = fork_server(["python", "launcher", "fake"], lambda: time.sleep(60) or 0, str(tmp_path), "fake ps:0")
    assert exited(server, 0.2) is None
    server.terminate()  # SIGTERM's default action: the supervisor's handler is not the server's
    assert exited(server, 30) == -signal.SIGTERM
    server.kill()  # (gone already: nothing to signal)


def test_a_server_forked_from_a_launcher_without_site_has_the_sites_packages(tmp_path: Path):
    """`start` runs `python -S LAUNCHER` (no site: the standard library only); a TensorFlow server
    forked from its supervisor imports TensorFlow from the site's packages, as its own `python
    LAUNCHER serve` would (a managed environment's server crashed on `import tensorflow` without
    them). The server's code here prints sys.path instead of serving."""
    launcher = str(_launcher(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[1:]\n"
            "from dtf_server import start\n"
            "before = list(sys.path)\n"
            "start.run_server = lambda argv: print(sorted(set(sys.path) - set(before))) or 0\n"
            "run, name = start.in_process([sys.executable, sys.argv[0], 'serve', '--job', 'ps'])\n"
            "print(name, run())\n")
    bare = subprocess.run([sys.executable, "-S", "-c", code, launcher], capture_output=True, text=True, timeout=60)
    site = subprocess.run([sys.executable, "-c", "import site, sys; print(sorted(site.getsitepackages()))"],
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == 0, bare.stderr
    added, last = bare.stdout.strip().splitlines()
    assert last == "serve 0"
    assert all(p in added for p in json.loads(site.stdout.replace("'", '"'))), (added, site.stdout)


def test_a_forked_server_dies_with_its_supervisor_however_it_dies(tmp_path: Path):
    """PR_SET_PDEATHSIG (procs.die_with_parent): a supervisor killed with SIGKILL, which runs
    nothing of its own on the way out, takes its server with it."""
    code = ("import os, sys, time\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from dtf_server.supervisor import exited, fork_server\n"
            "server = fork_server(['python', 'launcher', 'fake'], lambda: time.sleep(120) or 0, sys.argv[2], 'fake ps:0')\n"
            "print(server.pid, flush=True)\n"
            "time.sleep(120)\n")
    supervisor = subprocess.Popen([sys.executable, "-c", code, str(_launcher(tmp_path)), str(tmp_path)],
                                  stdout=subprocess.PIPE, text=True)
    try:
        assert supervisor.stdout is not None
        server = int(supervisor.stdout.readline())
        _wait(lambda: _proc(server, "comm").decode().strip() == "fake ps:0", "the server running")
    finally:
        supervisor.kill()
        supervisor.wait()
    _wait(lambda: not Path(f"/proc/{server}").exists()
          or _proc(server, "stat").decode().rsplit(")", 1)[1].split()[0] == "Z", "gone with its supervisor")


def test_die_with_parent_sets_the_parent_death_signal():
    code = ("from dtf_server.procs import die_with_parent\n"
            "die_with_parent(15)\n"
            "import ctypes\n"
            "value = ctypes.c_int(0)\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(value))\n"  # 2: PR_GET_PDEATHSIG
            "print(value.value)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "15"), r.stderr


def test_start_reports_a_server_that_serves_before_its_supervisor_recorded_it_by_its_pid(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A forked server can write ready.json and listen before its supervisor (descheduled right
    after the fork) records it: `start` waits for the record, so `up` shows the server's pid (the
    one `dtf status` shows), not `-`. The supervisor here records its server only once `start` has
    seen the server serving a few times."""
    [port] = listen_ports(1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    seen = threading.Semaphore(0)
    port_open = start.port_open

    def counting(p: int) -> bool:
        open_ = port_open(p)
        if open_:
            seen.release()
        return open_

    class Forked:
        pid = os.getpid()

        def poll(self) -> None:
            return None

    def fork(root: str, task: TaskSpec, *args: object, **kwargs: object) -> Forked:
        tdir = Path(protocol.Layout.task_dir(root, task.job, task.index))
        (tdir / protocol.Layout.READY).write_text(json.dumps({"pid": 4242}))

        def record() -> None:
            for _ in range(3):
                seen.acquire()
            (tdir / protocol.Layout.SUPERVISOR).write_text(json.dumps({"server_pid": 4242}))
        threading.Thread(target=record, daemon=True).start()
        return Forked()

    monkeypatch.setattr(start, "port_open", counting)
    monkeypatch.setattr(start, "fork_supervisor", fork)
    try:
        reply = start.cmd_start(protocol.StartRequest(
            dir=str(tmp_path / "c"), timeout=30, ttl=0, restart_limit=0, restart_backoff=1,
            task=[TaskSpec("worker", 0, port, ["serve"])]))
    finally:
        listener.close()
    assert reply.tasks["worker:0"].ok and reply.tasks["worker:0"].server_pid == 4242, reply
