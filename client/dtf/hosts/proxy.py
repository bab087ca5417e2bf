"""How `dtf train` carries the program's connections to one host's tasks (ssh network mode,
dtf.hosts.tunnel): a local HTTP CONNECT proxy (`Proxy`) hands each connection to its host's route.

- `Master` (dtf.hosts.masters): `ssh -W ADDR:PORT` over the host's master, the accepted socket as
  its stdin and stdout: the bytes are carried by OpenSSH, never copied by Python;
- `SharedMaster`: the same over the cluster's control master (dtf.hosts.control), to which the run
  adds its remote forward back to the coordinator;
- `PythonRoute`: where there is no `ssh` binary, a paramiko channel (`direct-tcpip`), copying in
  Python: slower, but it works.

A route whose master died (a dropped connection) is started again at the next CONNECT, which the
coordinator makes when it retries.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import HostError
from dtf.hosts.masters import Master, socket_id
from dtf.hosts.netutil import pump
from dtf.hosts.paramikossh import ParamikoRunner

REQUEST_LIMIT = 8192  # bytes of a CONNECT request, headers included
REQUEST_TIMEOUT = 10.0


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
            now = socket_id(self.master.path)
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
            if self.forwarded is not None and socket_id(self.master.path) == self.forwarded:
                self._forward("cancel")
            self.forwarded = None

    def channel_argv(self, target: str) -> list[str]:
        return self.master.channel_argv(target)



class PythonRoute:
    """The fallback where no `ssh` binary exists: channels of one paramiko connection."""

    def __init__(self, spec: HostSpec, ssh_config: str | None, connect_timeout: float,
                 chief_port: int | None = None) -> None:
        self.spec, self.ssh_config, self.connect_timeout = spec, ssh_config, connect_timeout
        self.chief_port = chief_port
        self.transport: ParamikoRunner | None = None
        self.lock = threading.Lock()

    def ensure(self) -> None:
        with self.lock:
            if self.transport is not None and self.transport.active():
                return
            if self.transport is not None:
                self.transport.close()
            self.transport = ParamikoRunner(self.spec, self.ssh_config, self.connect_timeout)
            self.transport.open()
            with contextlib.suppress(HostError):  # sshd sets TCP_NODELAY (see dtf.hosts.masters)
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
                    threading.Thread(target=pump, args=(local, channel), daemon=True, name="dtf-pump").start()

                self.transport.connection().transport.request_port_forward("127.0.0.1", port, handler=back)

    def carry(self, sock: socket.socket, target: str) -> None:
        assert self.transport is not None
        channel = self.transport.open_tcp(target, REQUEST_TIMEOUT)
        threading.Thread(target=pump, args=(sock, channel), daemon=True, name="dtf-pump").start()

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()


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
