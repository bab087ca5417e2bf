"""One task's supervisor, and the lease that lets an abandoned cluster clean itself up.

Each task is a supervisor process (its own session and process group) with the server as its
child in the same group: one `killpg` stops both. The supervisor runs the plan's serve command
exactly; when the server dies it starts it again on the same port, after a backoff (doubling for
deaths in quick succession, at most Defaults.RESTART_MAX_BACKOFF), at most `limit` times; then it
gives up and stays, server-less, until stopped or its lease lapses.

The lease: ROOT/lease.json holds {ttl, renewed} (this host's clock). dtf renews it while it uses
the cluster (`up`, `status`, `train`...). When `renewed + ttl` has passed, every supervisor stops
its server and the last one removes ROOT entirely. ttl 0: never.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from types import FrameType
from typing import Any

from dtf_server import firewall
from dtf_server.procs import (
    die_with_parent,
    expand_home,
    leave,
    log_line,
    name_process,
    ours,
    proc_start_ticks,
    read_json,
    settle_child,
    write_json,
)
from dtf_server.protocol import Defaults, DetachedLayout, Layout, Lease, TaskSpec, exit_reason

# Where a server can run in a fork of its supervisor (Supervisor's `in_process`): the server's
# code (which returns its exit code) and its command's name.
InProcess = Callable[[list[str]], "tuple[Callable[[], int], str] | None"]

SUPERVISE_POLL = 0.2  # how often a supervisor looks at its server
LEASE_POLL = 1.0  # how often a supervisor reads the lease


def lease_path(root: str) -> str:
    return os.path.join(root, Layout.LEASE)


def write_lease(root: str, ttl: float, hold: float = 0.0) -> Lease:
    """Renew the lease now; `hold` seconds more (a start in progress holds the lease: servers
    that take long to import TensorFlow must not see it lapse before they serve)."""
    lease = Lease(ttl=ttl, renewed=time.time() + hold)
    write_json(lease_path(root), asdict(lease))
    return lease


def read_lease(root: str) -> Lease | None:
    data = read_json(lease_path(root))
    try:
        return None if data is None else Lease(ttl=float(data["ttl"]), renewed=float(data["renewed"]))
    except (KeyError, TypeError, ValueError):
        return None


def renew(root: str, ttl: float | None) -> Lease | None:
    """Renew the lease, keeping its ttl unless one is given; None if the cluster's files are gone
    (a lapsed lease removed them: renewing must not bring an empty directory back)."""
    if not os.path.isdir(root):
        return None
    old = read_lease(root)
    lease = write_lease(root, (old.ttl if old else 0.0) if ttl is None else ttl)
    if os.path.exists(os.path.join(root, Layout.AUTHORIZED)):
        from dtf_server.sshkeys import refresh

        refresh(root, lease)  # a detached run's key lasts as long as the lease
    return lease


def running_tasks(root: str) -> list[str]:
    """Tasks below `root` whose supervisor is alive (as JOB:INDEX)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        record = read_json(os.path.join(root, name, Layout.PID))
        if ours(record):
            assert record is not None
            found.append(f"{record['job']}:{record['index']}")
    return found


class ForkedProcess:
    """A child forked from this process (a server from its supervisor: `fork_server`; a
    supervisor from `start`), with what they use of Popen's API: pid, returncode, poll, wait
    (without a timeout: see exited), send_signal, terminate, kill."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def exited(server: subprocess.Popen[bytes] | ForkedProcess, within: float) -> int | None:
    """The server's exit code once it has exited, waiting `within` seconds at most (None: it runs)."""
    end = time.monotonic() + within
    while (code := server.poll()) is None and time.monotonic() < end:
        time.sleep(min(0.01, max(0.0, end - time.monotonic())))
    return code


def fork_server(argv: list[str], run: Callable[[], int], cwd: str, name: str) -> ForkedProcess:
    """Run a server's code (`run`) in a fork of this supervisor, as `Popen(argv, cwd=cwd,
    stdin=DEVNULL, close_fds=True, preexec_fn=die_with_parent)` would run it in a python of its
    own, without a second interpreter's start and imports. The supervisor has no thread to lose
    in the fork.

    Its command line stays its supervisor's (the launcher's `start`); `name` is what `ps -e` and
    top call it (its comm: "serve worker:3", "fake ps:0"), as the supervisor is "dtf worker:3";
    `argv` is what its sys.argv says, as python's would (the launcher's path and the command)."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server: never returns into the supervisor's code
        code: object = 70
        try:
            die_with_parent()
            if os.getppid() != parent:  # it died before that took
                leave(70)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            settle_child(cwd, name)
            # A server's python ran with PYTHONUNBUFFERED (protocol's task environment): its lines
            # reach the log as they are written.
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            sys.argv = argv[1:]
            code = run()
        except SystemExit as e:  # what python's exit would make of it
            code = e.code
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            if code is None:
                code = 0
            elif not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            leave(code & 0xFF)
    return ForkedProcess(pid)


class Supervisor:
    """Keeps one task's server running; see the module's docstring for the policy.

    `in_process(argv)`: where the server's command can run in a fork of this supervisor instead
    of a new process (`fork_server`), the code to run there and its command's name; None: it
    cannot."""

    def __init__(self, root: str, task: TaskSpec, limit: int, backoff: float,
                 in_process: InProcess | None = None) -> None:
        self.root, self.task = root, task
        self.in_process = in_process
        self.limit, self.backoff = limit, backoff
        self.name = task.name
        self.dir = Layout.task_dir(root, task.job, task.index)
        self.ready = os.path.join(self.dir, Layout.READY)
        self.stopping = False
        self.server: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.state: dict[str, Any] = {"state": "starting", "restarts": 0, "last_exit": None,
                                      "server_pid": None, "server_ticks": None, "server_started": None}
        self.lease: Lease | None = None
        self.lease_read = 0.0

    def save(self, **changes: object) -> None:
        self.state.update(changes)
        write_json(os.path.join(self.dir, Layout.SUPERVISOR), self.state)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)

    def lease_lapsed(self) -> bool:
        now = time.monotonic()
        if now - self.lease_read >= LEASE_POLL:
            self.lease_read = now
            self.lease = read_lease(self.root) or self.lease  # unreadable: keep the last
        if not self.lease or not self.lease.ttl:
            return False
        return time.time() > self.lease.renewed + self.lease.ttl

    def spawn(self) -> None:
        if os.path.exists(self.ready):
            os.unlink(self.ready)
        argv = expand_home(self.task.argv)
        forked = self.in_process(argv) if self.in_process is not None else None
        if forked is not None:
            run, command = forked
            self.server = fork_server(argv, run, cwd=self.dir, name=f"{command} {self.name}")
        else:
            self.server = subprocess.Popen(  # same process group: `stop` signals both at once
                argv, stdin=subprocess.DEVNULL, cwd=self.dir, close_fds=True, preexec_fn=die_with_parent)
        self.save(state="running", server_pid=self.server.pid,
                  server_ticks=proc_start_ticks(self.server.pid), server_started=time.time())

    def wait_server(self) -> int | None:
        """Wait until the server exits (its returncode), or the supervisor is stopped or the
        lease lapses (None).

        On a pidfd of the server (Linux 5.3+), which turns readable the moment it exits: Popen's
        own wait with a timeout polls (Popen._wait in Lib/subprocess.py: up to 50 ms apart), and
        `down` waits for the supervisor to see its server gone (a TensorFlow server is dead at once
        on TERM, its default action)."""
        server = self.server
        assert server is not None
        try:
            pidfd: int | None = os.pidfd_open(server.pid)
        except (AttributeError, OSError):  # before Python 3.9 or Linux 5.3; or already reaped
            pidfd = None
        try:
            while True:
                if pidfd is not None:
                    select.select([pidfd], [], [], SUPERVISE_POLL)  # a signal's handler runs, the wait goes on
                    code = server.poll()
                    if code is not None:
                        return code
                elif (code := exited(server, SUPERVISE_POLL)) is not None:
                    return code
                if self.stopping or self.lease_lapsed():  # a server that ignores TERM: stop_server KILLs it
                    return None
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def sleep(self, seconds: float) -> bool:
        """Sleep, unless stopped or the lease lapses first (False)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stopping or self.lease_lapsed():
                return False
            time.sleep(min(SUPERVISE_POLL, max(0.0, end - time.monotonic())))
        return not self.stopping

    def stop_server(self) -> None:
        if self.server is None or self.server.poll() is not None:
            return
        self.server.terminate()
        if exited(self.server, Defaults.SERVER_STOP_GRACE) is None:
            self.server.kill()
            self.server.wait()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        log_line(f"{self.name}: supervising its server on port {self.task.port} "
                 f"(restart limit {self.limit}, backoff {self.backoff:g}s)")
        quick_deaths = 0
        while not self.stopping:
            self.spawn()
            code = self.wait_server()
            if code is None or self.stopping:  # stopped, or the lease lapsed
                break
            now = time.time()
            ran = now - self.state["server_started"]
            quick_deaths = 1 if ran >= Defaults.STABLE_AFTER else quick_deaths + 1
            reason = exit_reason(code)
            self.save(state="restarting", last_exit=reason, server_pid=None, server_ticks=None)
            if self.state["restarts"] >= self.limit:
                log_line(f"{self.name}: server {reason} after {ran:.1f}s; restart limit "
                         f"({self.limit}) reached: giving up")
                self.save(state="failed")
                while self.sleep(3600):  # stay (server-less) until stopped or the lease lapses
                    pass
                break
            delay = min(self.backoff * 2 ** (quick_deaths - 1), Defaults.RESTART_MAX_BACKOFF)
            log_line(f"{self.name}: server {reason} after {ran:.1f}s; restart "
                     f"{self.state['restarts'] + 1} of {self.limit} in {delay:g}s")
            if not self.sleep(delay):
                break
            self.save(restarts=self.state["restarts"] + 1)
        self.stop_server()
        if not self.stopping and self.lease_lapsed():
            self.expire()
        return 0

    def expire(self) -> None:
        """The lease lapsed: remove this task's files; the last task to go removes the root."""
        assert self.lease is not None
        log_line(f"{self.name}: lease lapsed (ttl {self.lease.ttl:g}s): stopping and cleaning up")
        try:
            lock = open(os.path.join(self.root, Layout.EXPIRE_LOCK), "a")
        except OSError:
            return  # already removed by another task
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one task at a time: the last one sees no others
            shutil.rmtree(self.dir, ignore_errors=True)
            if not running_tasks(self.root):
                from dtf_server.sshkeys import deauthorize, end_connections

                end_connections(self.root)  # and a detached run's SSH connections and key
                deauthorize(self.root)
                firewall.remove(self.root)  # the TF ports' firewall rules go with the cluster
                remove_root(self.root)


def remove_root(root: str) -> None:
    """A cluster's files on this host, once its lease lapsed: all of them, but a detached run's
    (DetachedLayout: its output and what its program wrote, the user's until fetched by `dtf
    attach` or `dtf down`, which remove them then). Nothing of it runs."""
    kept = DetachedLayout.dir(root)
    if not os.path.exists(os.path.join(kept, DetachedLayout.SPEC)):
        shutil.rmtree(root, ignore_errors=True)
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path == kept:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def keep() -> None:
    """`start --keep`: this launcher is a Slurm node's job step (dtf.providers.slurm.steps: start_servers),
    which lasts as long as its main process: Slurm would end the step, the supervisors forked here
    with it, if this one exited. It stays, silent (the reply was its last word: the login host
    reads until then), until every supervisor it forked has ended (`down`, the lease, a failed
    start's rollback); Slurm signals it with the rest of the step when the job ends."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    name_process("dtf step")
    while True:
        try:
            os.wait()  # (a signal's EINTR is retried by Python itself: PEP 475)
        except ChildProcessError:
            return
