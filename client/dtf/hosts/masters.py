"""OpenSSH master connections (ControlMaster): one per host, channels and commands share it.

A master is started with `ssh -M -N -f` (its stderr in a log file next to its socket) and kept
`ControlPersist` seconds after its last use. dtf.hosts.control keeps one per host for the
cluster's life; `dtf train`'s ssh network mode (dtf.hosts.tunnel) carries its connections over
the same ones.

Latency: an sshd before OpenSSH 10.1 turns Nagle's algorithm off (TCP_NODELAY) on its connection
only when a session starts, and a master started with `-N` has none. With Nagle on, a reply that
the task writes in two parts waits for the laptop's delayed ACK. So each master runs one empty
session (`true`) as soon as it is up (`Master.start`); the option stays for the connection's
life. A jump host's sshd (ProxyJump) has the same flaw and ssh's own jump connection never has a
session: dtf opens a master of its own to each hop (in the order ssh would), runs the session
there too, and reaches the next hop through it (ProxyCommand `ssh -S HOP -W`), so the bytes still
never cross Python.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from dtf.cluster.inventory import HostSpec
from dtf.hosts import mux
from dtf.hosts.base import HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.hosts.openssh import ALIVE_INTERVAL, settings, ssh_argv

PERSIST = 60  # ControlPersist: seconds an unused master stays (a killed `dtf train` leaves none behind)


MAX_HOPS = 8  # jump hosts followed (ssh_config can loop)


def parse_jump(text: str, spec: HostSpec) -> HostSpec:
    """One ProxyJump hop (`[ssh://][user@]host[:port]`, IPv6 in brackets) as a spec of its own:
    ssh_config and the agent decide the rest, as for ssh's own jump connection."""
    text = text.strip().removeprefix("ssh://")
    user, _, host = text.rpartition("@")
    port: int | None = None
    if host.startswith("["):
        host, _, rest = host[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    elif host.count(":") == 1 and host.split(":")[1].isdigit():
        host, port = host.split(":")[0], int(host.split(":")[1])
    return replace(spec, host=host, user=user or None, port=port, identity_file=None)


# -- a master's process: started, asked whether it answers, closed ---------------------------
STOP_WAIT = 5.0  # seconds a master has to exit after `-O exit`


def listening(path: str) -> bool:
    """Whether a master answers on the socket (a connect, no process started)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _wait_exited(pid: int, timeout: float) -> bool:
    """Until process `pid` has ended (or is a zombie, where /proc says so); False at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except (OSError, IndexError):
            pass
        time.sleep(0.02)
    return False


def stop_master(ssh: str, path: str) -> None:
    """Close the master at `path` and wait until it has exited (a hop's carries the hosts' until
    they have); its socket is removed. Asked of the master itself (dtf.hosts.mux: `dtf down`
    closes one per host, and two ssh processes each were most of its CPU here), else, where it
    does not take that or DTF_SSH_MUX=0, with `ssh -O check` and `ssh -O exit`."""
    pid: int | None = None
    if mux.enabled() and listening(path):
        with contextlib.suppress(mux.MuxRefused):
            pid = mux.terminate(path)
    if pid is None:
        pid = _stop_by_ssh(ssh, path)
    if pid is not None:
        _wait_exited(pid, STOP_WAIT)
    try:
        os.unlink(path)
    except OSError:
        pass


def _stop_by_ssh(ssh: str, path: str) -> int | None:
    """`ssh -O exit` to the master at `path`: its process id once it agreed to exit, else None."""

    def control(command: str) -> str | None:
        try:
            # The host argument is required and ignored: the socket names the master.
            r = subprocess.run([ssh, "-S", path, "-O", command, "dtf-host"], capture_output=True, text=True,
                               timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stderr + r.stdout if r.returncode == 0 else None

    checked = control("check") if listening(path) else None
    m = re.search(r"pid=(\d+)", checked or "")
    return int(m.group(1)) if m and control("exit") is not None else None


def start_master(argv: list[str], path: str) -> subprocess.Popen[bytes]:
    """Start a master's ssh (`-N -f` in `argv`: it exits once the master runs, or failed) with its
    control socket at `path` and its stderr in `path`.log: a file, not a pipe, for the master that
    `-f` leaves behind keeps it open. A dead master's socket at `path` is removed first: ssh would
    not replace it, and would run unshared."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with open(path + ".log", "w") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


class MasterFailed(HostError):
    """A master (to the host, or to one of its jump hosts: `spec`) did not start: ssh's `log`."""

    def __init__(self, message: str, spec: HostSpec, log: str, timed_out: bool) -> None:
        super().__init__(message)
        self.spec, self.log, self.timed_out = spec, log, timed_out


_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _lock_for(path: str) -> threading.Lock:
    """One lock per control path in this process: the hosts behind one jump host share its master,
    and their threads must start it once."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(path, threading.Lock())


class Master:
    """One OpenSSH master connection to a host; `ssh -W` channels share it. Where ssh_config
    names jump hosts, each hop gets a master of its own (`hops`), the next reached through it:
    at `hop_path(hop)` when given (shared by every host behind that hop), else one per host."""

    def __init__(self, ssh: str, spec: HostSpec, ssh_config: str | None, path: str,
                 connect_timeout: float = CONNECT_TIMEOUT, chief_port: int | None = None,
                 through: Master | None = None, depth: int = 0, persist: int = PERSIST,
                 hop_path: Callable[[HostSpec], str] | None = None, session: bool = True,
                 alive: int = ALIVE_INTERVAL) -> None:
        self.ssh, self.spec, self.ssh_config, self.path = ssh, spec, ssh_config, path
        self.connect_timeout = connect_timeout
        self.chief_port = chief_port  # forwarded from the host's loopback back to this machine
        self.through = through  # the jump host's master this one connects through (None: ssh decides)
        self.depth = depth
        self.persist = persist  # ControlPersist: seconds the master stays once no command uses it
        self.hop_path = hop_path
        self.session = session  # run the empty session at start (a caller whose first use is one: no)
        self.lock = _lock_for(path)
        self.alive_interval = alive  # ServerAliveInterval: a lost host ends the master after 3 of them
        self.argv: list[str] | None = None  # the ssh `start` ran (None: none, or one behind jump hosts)

    def _control(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str] | None:
        try:
            r = subprocess.run([self.ssh, "-S", self.path, "-O", command, self.spec.host],
                               capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r if r.returncode == 0 else None

    def pid(self) -> int | None:
        """The master's process id (`ssh -O check` says "Master running (pid=N)"); None if none runs."""
        r = self._control("check") if os.path.exists(self.path) else None
        m = re.search(r"pid=(\d+)", r.stderr + r.stdout) if r else None
        return int(m.group(1)) if m else None

    def alive(self) -> bool:
        return os.path.exists(self.path) and self._control("check") is not None

    def jumps(self) -> list[HostSpec]:
        """The jump hosts ssh would go through to this host (`ssh -G`: ssh_config resolved), first
        hop first; none where this master connects through one of dtf's or ssh_config has none."""
        if self.through is not None or self.depth >= MAX_HOPS:
            return []
        value = settings(self.ssh, self.spec, self.ssh_config).get("proxyjump", "")
        if value and value.lower() != "none":
            return [parse_jump(hop, self.spec) for hop in value.split(",")]
        return []

    def hops(self) -> list[Master]:
        """Masters to this host's jump hosts, each reached through the one before (the first as
        ssh_config says, its own jumps included)."""
        out: list[Master] = []
        for i, hop in enumerate(self.jumps()):
            path = self.hop_path(hop) if self.hop_path else f"{self.path}-j{i}"
            out.append(Master(self.ssh, hop, self.ssh_config, path, self.connect_timeout,
                              through=out[-1] if out else None, depth=self.depth + 1, persist=self.persist,
                              alive=self.alive_interval))
        return out

    def start(self) -> None:
        hops = self.hops()
        for hop in hops:
            hop.ensure()
        through = hops[-1] if hops else self.through
        via = ["-o", "ProxyCommand=" + shlex.join(through.channel_argv("[%h]:%p"))] if through else []
        log = Path(self.path + ".log")
        back = (["-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{self.chief_port}:127.0.0.1:{self.chief_port}"]
                if self.chief_port else [])
        argv = ssh_argv(self.ssh, self.spec, self.ssh_config, self.connect_timeout, *via,
                        "-o", "ControlMaster=yes", "-o", f"ControlPath={self.path}",
                        "-o", f"ControlPersist={self.persist}", *back, "-N", "-f", alive=self.alive_interval)
        proc = start_master(argv, self.path)
        try:
            code: int | None = proc.wait(timeout=self.connect_timeout + 20)
        except BaseException as e:
            # Past the deadline, or interrupted (Ctrl-C) while ssh connects: its own session keeps
            # it from the signal, so end it here, and the master it may have forked meanwhile
            # (ssh listens on the socket before `-f` forks), or one would stay for ControlPersist.
            proc.kill()
            proc.wait()
            stop_master(self.ssh, self.path)
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            code = None
        self.argv = None if hops else argv
        if code != 0:
            lines = [s for s in log.read_text(errors="replace").splitlines() if s.strip()]
            why = lines[-1] if lines else ("no answer" if code is None else f"ssh exited {code}")
            what = f"to jump host {self.spec.host} " if self.depth else ""
            raise MasterFailed(f"SSH connection {what}for the TF ports failed: {why}", self.spec,
                               "\n".join(lines), code is None)
        if self.session:
            self._session()

    def _session(self) -> None:
        """One empty session over the master: sshd sets TCP_NODELAY then (see the module's doc).
        A host that refuses sessions still carries channels, only slower: not an error."""
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([self.ssh, "-S", self.path, "-o", "ControlMaster=no", self.spec.host, "true"],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=self.connect_timeout + 10)

    def ensure(self) -> None:
        """Start the master unless it runs (again, after it was lost). A socket that accepts a
        connection is a running master: 100 hosts behind one jump host ask at once, and an
        `ssh -O check` each, one after another under the lock, would take seconds."""
        if listening(self.path):
            return
        with self.lock:
            if not self.alive():
                self.start()

    def stop(self) -> None:
        """Close this master, then the masters of its jump hosts (last hop first). Each is waited
        for: `-O exit` answers before the master has gone, and a jump host's master still carries
        the channel of the master behind it until that one has exited."""
        stop_master(self.ssh, self.path)
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".log")
        hops = sorted((p for p in glob.glob(glob.escape(self.path) + "-j*") if not p.endswith(".log")), reverse=True)
        for path in hops:
            Master(self.ssh, self.spec, None, path).stop()

    def channel_argv(self, target: str) -> list[str]:
        """`ssh -W`: this process's stdin and stdout become a TCP connection to `target`, opened
        by the host (so `target` is resolved and reached from there)."""
        return [self.ssh, "-S", self.path, "-o", "ControlMaster=no", "-W", target, self.spec.host]


def socket_id(path: str) -> tuple[int, int] | None:
    """Which master answers at `path`: a master started again makes a new socket (inode, ctime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns



def parallel(calls: Sequence[Callable[[], object]]) -> list[BaseException | None]:
    """Run the calls at once; each one's exception, or None."""
    if not calls:
        return []
    from concurrent.futures import ThreadPoolExecutor  # (here: it imports logging, a cost to every start)

    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="dtf-ssh") as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.exception() for f in futures]
