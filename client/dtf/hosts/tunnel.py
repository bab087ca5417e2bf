"""SSH network mode: the laptop reaches the tasks' TF ports only through SSH.

The hosts keep talking to each other at their cluster addresses; only the laptop's own connections
travel through SSH (FACTS.md, "Reaching tasks through SSH"). `dtf train` starts a `Tunnel`:

- over the cluster's OpenSSH master to each host (dtf.hosts.control: opened by `up` and kept for
  the cluster's life, so a training makes no new SSH handshake; ControlMaster, so that
  ~/.ssh/config, the agent and ProxyJump apply as they do for the user's own `ssh`): `SharedMaster`;
- a remote forward on each master from the host's 127.0.0.1:P back to this machine's P, the
  chief's port, added to the running master for the run (`ssh -O forward`) and cancelled at its
  end: tasks that call the coordinator back (the ps does when a checkpoint is written through it)
  reach it there, even from behind NAT;
- a local HTTP CONNECT proxy, handed to the program as `grpc_proxy` (TensorFlow's gRPC honours
  it). For each CONNECT to a planned task address it starts `ssh -W ADDR:PORT` over that host's
  master with the accepted socket as its stdin and stdout: the bytes are carried by OpenSSH, never
  copied by Python. Any other target is refused. A master that died (a dropped connection) is
  started again at the next CONNECT, which the coordinator makes when it retries.

Latency: an sshd before OpenSSH 10.1 turns Nagle's algorithm off (TCP_NODELAY) on its connection
only when a session starts, and a master started with `-N` has none. With Nagle on, a reply that
the task writes in two parts waits for the laptop's delayed ACK: 40 ms per round trip instead of
0.2. So each master runs one empty session (`true`) as soon as it is up (`Master.start`,
`PythonRoute.ensure`); the option stays for the connection's life. A jump host's sshd (ProxyJump)
has the same flaw and ssh's own jump connection never has a session: dtf opens a master of its
own to each hop (in the order ssh would), runs the session there too, and reaches the next hop
through it (ProxyCommand `ssh -S HOP -W`), so the bytes still never cross Python.

Where there is no `ssh` binary, the same proxy carries connections over a paramiko channel
(`direct-tcpip`), copying in Python: slower, but it works.

On a Slurm cluster the laptop reaches only the login host: the tunnel has that one route, whose
`ssh -W` targets are the compute nodes' task addresses (the login host opens those connections),
and the tasks reach the coordinator back through a relay on the login host (`LoginRelay`,
dtf_server.relay: why there, in its doc).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import select
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dtf.cluster.inventory import HostSpec
from dtf.hosts import spawn
from dtf.hosts.netutil import CONNECT_TIMEOUT, listen_port
from dtf.hosts.openssh import ALIVE_INTERVAL, settings, ssh_argv, ssh_binary
from dtf.hosts.spawn import STOP_WAIT, _wait_exited
from dtf.hosts.transport import HostError, SSHTransport

PERSIST = 60  # ControlPersist: seconds an unused master stays (a killed `dtf train` leaves none behind)
REQUEST_LIMIT = 8192  # bytes of a CONNECT request, headers included
REQUEST_TIMEOUT = 10.0


def control_dir() -> Path:
    """Where dtf's SSH masters keep their sockets: short (a Unix socket path has ~100 bytes)."""
    return Path(tempfile.gettempdir()) / f"dtf-ssh-{os.getuid()}"


def control_path(home: Path, cluster: str, host: str) -> str:
    key = hashlib.sha256(f"{home}\0{cluster}\0{host}".encode()).hexdigest()[:16]
    return str(control_dir() / key)


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
        proc = spawn.start(argv, self.path)
        try:
            code: int | None = proc.wait(timeout=self.connect_timeout + 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
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
        `ssh -O check` each, one after another under the lock, took seconds."""
        if spawn.listening(self.path):
            return
        with self.lock:
            if not self.alive():
                self.start()

    def stop(self) -> None:
        """Close this master, then the masters of its jump hosts (last hop first). Each is waited
        for: `-O exit` answers before the master has gone, and a jump host's master still carries
        the channel of the master behind it until that one has exited."""
        pid = self.pid()
        if pid is not None and self._control("exit") is not None:
            _wait_exited(pid, STOP_WAIT)
        with contextlib.suppress(OSError):
            os.unlink(self.path + ".log")
        hops = sorted((p for p in glob.glob(glob.escape(self.path) + "-j*") if not p.endswith(".log")), reverse=True)
        for path in hops:
            Master(self.ssh, self.spec, None, path).stop()

    def channel_argv(self, target: str) -> list[str]:
        """`ssh -W`: this process's stdin and stdout become a TCP connection to `target`, opened
        by the host (so `target` is resolved and reached from there)."""
        return [self.ssh, "-S", self.path, "-o", "ControlMaster=no", "-W", target, self.spec.host]


def _socket_id(path: str) -> tuple[int, int] | None:
    """Which master answers at `path`: a master started again makes a new socket (inode, ctime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class SharedMaster:
    """A route over the cluster's control master (dtf.hosts.control), which outlives the run: the
    run adds its remote forward back to the coordinator to it and cancels it at the end; the master
    stays. A master that was lost is started again (with its empty session) at the next CONNECT,
    and the forward added to the new one."""

    def __init__(self, master: Master, chief_port: int | None) -> None:
        self.master, self.spec, self.chief_port = master, master.spec, chief_port
        self.lock = threading.Lock()
        self.forwarded: tuple[int, int] | None = None  # the master (_socket_id) that holds the forward

    def _forward(self, op: str) -> subprocess.CompletedProcess[str] | None:
        spec = f"127.0.0.1:{self.chief_port}:127.0.0.1:{self.chief_port}"
        try:
            return subprocess.run([self.master.ssh, "-S", self.master.path, "-O", op, "-R", spec, self.spec.host],
                                  capture_output=True, text=True, timeout=self.master.connect_timeout + 10,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def ensure(self) -> None:
        with self.lock:
            self.master.ensure()
            now = _socket_id(self.master.path)
            if self.chief_port and now != self.forwarded:
                r = self._forward("forward")
                if r is None or r.returncode != 0:
                    why = (r.stderr.strip().splitlines() or ["?"])[-1] if r is not None else "no answer"
                    raise HostError(f"the way back to the coordinator (a remote forward of port "
                                    f"{self.chief_port}) failed: {why}")
                self.forwarded = now

    def stop(self) -> None:
        """Cancel the run's forward; the master stays (it is the cluster's)."""
        with self.lock:
            if self.forwarded is not None and _socket_id(self.master.path) == self.forwarded:
                self._forward("cancel")
            self.forwarded = None

    def channel_argv(self, target: str) -> list[str]:
        return self.master.channel_argv(target)


RELAY_READY = 20.0  # seconds the login host's relay gets to say where it listens
RELAY_RETRY = 1.0  # seconds between two looks at the relay (started again if its session ended)


class LoginRelay:
    """Slurm: the relay on the login host (dtf_server.relay) that carries the tasks' connections to
    the coordinator into the login master's remote forward. It runs in a session over that master
    and ends with it; started again if the session ended (a lost master) while the tunnel is open."""

    def __init__(self, master: Master, port: int, nodes: Sequence[str], python: str,
                 timeout: float = RELAY_READY) -> None:
        self.master, self.port, self.nodes, self.python, self.timeout = master, port, list(nodes), python, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.closed = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="dtf-relay-watch")

    def argv(self) -> list[str]:
        from dtf_server import relay

        source = Path(relay.__file__).read_text()
        remote = shlex.join([self.python, "-c", source, str(self.port), str(self.port), *self.nodes])
        return [self.master.ssh, "-S", self.master.path, "-o", "ControlMaster=no", self.master.spec.host, remote]

    def start(self) -> str:
        """Start the relay; the address it listens on (HostError: it did not say in time)."""
        proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self.proc = proc
        assert proc.stdout is not None
        line = b""
        deadline = time.monotonic() + self.timeout
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
        text = line.decode(errors="replace").strip()
        if not text.startswith("listening "):
            self._end()
            err = b""
            if proc.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    err = proc.stderr.read(4096) if proc.poll() is not None else b""
            why = text.removeprefix("error: ") or (err.decode(errors="replace").strip().splitlines() or
                                                  [f"no answer in {self.timeout:g}s"])[-1]
            raise HostError(f"the relay back to the coordinator on the login host failed: {why}")
        self.address = text.split()[1]
        return self.address

    def open(self) -> str:
        address = self.start()
        self.watcher.start()
        return address

    def _watch(self) -> None:
        while not self.closed.wait(RELAY_RETRY):
            if self.proc is not None and self.proc.poll() is None:
                continue
            with contextlib.suppress(HostError, OSError):  # the login host is unreachable now: try again later
                self.master.ensure()
                if not self.closed.is_set():
                    self.start()

    def _end(self) -> None:
        proc = self.proc
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()  # the relay's stdin closes: it exits
        if proc.poll() is None:
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.closed.set()
        if self.watcher.is_alive():
            self.watcher.join(timeout=RELAY_RETRY + self.timeout + 5)
        self._end()


class PythonRoute:
    """The fallback where no `ssh` binary exists: channels of one paramiko connection."""

    def __init__(self, spec: HostSpec, ssh_config: str | None, connect_timeout: float,
                 chief_port: int | None = None) -> None:
        self.spec, self.ssh_config, self.connect_timeout = spec, ssh_config, connect_timeout
        self.chief_port = chief_port
        self.transport: SSHTransport | None = None
        self.lock = threading.Lock()

    def ensure(self) -> None:
        with self.lock:
            if self.transport is not None and self.transport.active():
                return
            if self.transport is not None:
                self.transport.close()
            self.transport = SSHTransport(self.spec, self.ssh_config, self.connect_timeout)
            self.transport.open()
            with contextlib.suppress(HostError):  # sshd sets TCP_NODELAY (see the module's doc)
                self.transport.run(["true"], timeout=self.connect_timeout + 10)
            hop = self.transport.connection().gateway
            while hop is not None and not isinstance(hop, str):  # the jump hosts' sshd too
                with contextlib.suppress(Exception):  # best effort: a refused session only costs speed
                    hop.run("true", hide=True, warn=True, timeout=self.connect_timeout + 10, in_stream=False)
                hop = hop.gateway
            if self.chief_port:
                port = self.chief_port

                def back(channel: Any, origin: object, server: object) -> None:
                    try:
                        local = socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT)
                    except OSError:
                        channel.close()
                        return
                    local.settimeout(None)
                    threading.Thread(target=_pump, args=(local, channel), daemon=True, name="dtf-pump").start()

                self.transport.connection().transport.request_port_forward("127.0.0.1", port, handler=back)

    def carry(self, sock: socket.socket, target: str) -> None:
        assert self.transport is not None
        channel = self.transport.open_tcp(target, REQUEST_TIMEOUT)
        threading.Thread(target=_pump, args=(sock, channel), daemon=True, name="dtf-pump").start()

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _pump(sock: socket.socket, channel: Any) -> None:
    """Copy both ways between a local socket and a paramiko channel until either closes."""
    try:
        while True:
            ready, _, _ = select.select([sock, channel], [], [], 60)
            for source, sink in ((sock, channel), (channel, sock)):
                if source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    sink.sendall(data)
    except OSError:
        pass
    finally:
        channel.close()
        sock.close()


@dataclass
class Route:
    """How connections to one host's tasks are carried."""

    host: str
    via: Master | SharedMaster | PythonRoute
    targets: set[str] = field(default_factory=set)


class Proxy:
    """An HTTP CONNECT proxy on 127.0.0.1 for the planned task addresses only."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = {t.lower(): r for r in routes for t in r.targets}
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.children: list[subprocess.Popen[bytes]] = []
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dtf-proxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        self.thread.start()
        return self

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="dtf-proxy-conn").start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            target = _read_connect(conn)
        except (OSError, ValueError):
            conn.close()
            return
        route = self.routes.get(target.lower())
        if route is None:
            _reply(conn, "403 Forbidden", f"dtf: {target} is not a task of this cluster\n")
            conn.close()
            return
        try:
            route.via.ensure()
            _reply(conn, "200 Connection established")
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # ssh writes replies in parts too
            if isinstance(route.via, (Master, SharedMaster)):
                child = subprocess.Popen(route.via.channel_argv(target), stdin=conn.fileno(),
                                         stdout=conn.fileno(), stderr=subprocess.DEVNULL,
                                         start_new_session=True)
                self.children.append(child)
                conn.close()  # ssh holds it now
                threading.Thread(target=child.wait, daemon=True, name="dtf-proxy-reap").start()
            else:
                route.via.carry(conn, target)
        except Exception:  # the host is unreachable now: the coordinator sees a closed channel, retries
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 5
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            if child.poll() is None:
                child.kill()


def _read_connect(conn: socket.socket) -> str:
    """The target of an HTTP CONNECT request, read up to the end of its headers (not beyond: the
    bytes after it belong to the tunnelled connection)."""
    conn.settimeout(REQUEST_TIMEOUT)
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        chunk = conn.recv(1)
        if not chunk or len(data) > REQUEST_LIMIT:
            raise ValueError("incomplete request")
        data += chunk
    method, target, _ = (data.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""])[:3]
    if method.upper() != "CONNECT" or ":" not in target:
        _reply(conn, "405 Method Not Allowed")
        raise ValueError(f"not a CONNECT: {method}")
    return target


def _reply(conn: socket.socket, status: str, body: str = "") -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())


class Tunnel:
    """Everything `dtf train` needs in ssh mode: a route per host and the proxy. A context
    manager: on exit the proxy, its channels and the masters are gone."""

    def __init__(self, hosts: Sequence[tuple[HostSpec, Sequence[str]]], ssh_config: str | None,
                 home: Path, cluster: str, connect_timeout: float = CONNECT_TIMEOUT,
                 relay_for: Sequence[str] = (), shared: Callable[[HostSpec], Master] | None = None) -> None:
        """`relay_for`: a Slurm allocation's node addresses; `hosts` is then its login host alone,
        whose relay carries the tasks' connections back to the coordinator (LoginRelay).
        `shared`: the cluster's master to a host (dtf.hosts.control), carrying the run's connections
        (SharedMaster); without it, each host gets a master of its own that ends with the run."""
        ssh = ssh_binary()
        # The chief's port: the tasks reach the coordinator at 127.0.0.1:PORT on their own host, a
        # remote forward of each host's SSH connection back to this machine (a checkpoint written
        # through the coordinator has the ps fetch from it; behind NAT nothing else reaches it).
        self.chief_port = listen_port("127.0.0.1")
        self.routes = []
        for spec, targets in hosts:
            via: Master | SharedMaster | PythonRoute
            if ssh and shared is not None:
                via = SharedMaster(shared(spec), self.chief_port)
            elif ssh:
                via = Master(ssh, spec, ssh_config, control_path(home, cluster, spec.host), connect_timeout,
                             self.chief_port)
            else:
                via = PythonRoute(spec, ssh_config, connect_timeout, self.chief_port)
            self.routes.append(Route(spec.host, via, set(targets)))
        self.proxy = Proxy(self.routes)
        self.relay: LoginRelay | None = None
        if relay_for:
            login = self.routes[0].via
            if not isinstance(login, Master):
                raise HostError("a Slurm cluster's tasks reach the coordinator through OpenSSH's remote "
                                "forward: install the ssh client (`ssh` on the PATH)")
            self.relay = LoginRelay(login, self.chief_port, relay_for, login.spec.python)

    @property
    def chief_address(self) -> str:
        """Where the tasks reach the coordinator: 127.0.0.1 on each host (its remote forward), or
        on Slurm the login host's relay."""
        if self.relay is not None:
            return self.relay.address
        return f"127.0.0.1:{self.chief_port}"

    def env(self, direct: Sequence[str] = ()) -> dict[str, str]:
        """The program's environment: its gRPC channels go through the proxy, except to loopback
        and `direct` hosts (names or addresses)."""
        return {"grpc_proxy": self.proxy.url,
                "no_grpc_proxy": ",".join(["localhost", "127.0.0.1", "::1", *direct])}

    def __enter__(self) -> Tunnel:
        try:
            errors = _parallel([r.via.ensure for r in self.routes])
            failed = {r.host: str(e) for r, e in zip(self.routes, errors) if e is not None}
            if failed:
                from dtf.errors import HostFailure

                raise HostFailure("dtf train (SSH to the TF ports)", failed)
            if self.relay is not None:
                try:
                    self.relay.open()
                except HostError as e:
                    from dtf.errors import HostFailure

                    raise HostFailure("dtf train (the way back to the coordinator)", {self.routes[0].host: str(e)})
            self.proxy.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proxy.close()
        if self.relay is not None:
            self.relay.close()
        _parallel([r.via.stop for r in self.routes])


def _parallel(calls: Sequence[Callable[[], object]]) -> list[BaseException | None]:
    """Run the calls at once; each one's exception, or None."""
    if not calls:
        return []
    from concurrent.futures import ThreadPoolExecutor  # (here: 10 ms of an `up`'s first handshake, logging's)

    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="dtf-ssh") as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.exception() for f in futures]


def close_masters(home: Path, cluster: str, hosts: Sequence[HostSpec]) -> int:
    """Close any master dtf left for this cluster's hosts (`dtf down`); how many were open."""
    ssh = ssh_binary()
    if not ssh:
        return 0
    masters = [Master(ssh, spec, None, control_path(home, cluster, spec.host)) for spec in hosts]
    open_ = [m for m in masters if os.path.exists(m.path) or glob.glob(glob.escape(m.path) + "-j*")]  # hops too
    _parallel([m.stop for m in open_])
    return len(open_)
