"""Small network helpers shared by the client: free ports, TCP probes with deadlines."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

CONNECT_TIMEOUT = 10.0  # seconds to open TCP, read the SSH banner, and authenticate (a host's SSH)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free on `host` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


LISTEN_LOW = 10000  # the lowest port listen_port() picks (above the well-known and registered ones in use)


def _ephemeral_low() -> int:
    """The first port the kernel gives outgoing connections (Linux; 32768 elsewhere, below
    macOS's and Windows' 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str = "0.0.0.0") -> int:
    """A port free on `host` now, for a listener that binds it later (the coordinator's gRPC
    server binds once TensorFlow is imported: seconds). Picked below the kernel's range for
    outgoing connections: a port from `bind(host, 0)` is in that range, and any connect() made
    meanwhile may take it (the coordinator then fails with "Could not start gRPC server", most
    often on a busy machine). Where that range leaves too little room below it, any free port."""
    import random

    low = _ephemeral_low()
    if low - LISTEN_LOW >= 1000:
        pick = random.SystemRandom()
        for _ in range(100):
            port = pick.randrange(LISTEN_LOW, low)
            try:
                with socket.socket() as s:
                    s.bind((host, port))
                return port
            except OSError:
                continue
    return free_ports(1, host)[0]


def listen_ports(count: int, host: str = "0.0.0.0") -> list[int]:
    """`count` distinct ports, each picked as `listen_port` picks one: for listeners that bind
    later (a cluster's servers on this machine), out of the way of outgoing connections."""
    ports: list[int] = []
    for _ in range(100 * count):
        if len(ports) == count:
            break
        port = listen_port(host)
        if port not in ports:
            ports.append(port)
    return ports if len(ports) == count else free_ports(count, host)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if a TCP connection to host:port succeeds within `timeout` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, deadline: float, interval: float = 0.1) -> bool:
    """Poll host:port until it accepts a connection or time.monotonic() passes `deadline`."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if port_open(host, port, timeout=min(1.0, remaining)):
            return True
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


T = TypeVar("T")
PROBES_AT_ONCE = 32


def probe_all(probe: Callable[[T], bool], tasks: Sequence[T]) -> list[bool]:
    """`probe` each task, all at once (PROBES_AT_ONCE threads at most): a host that drops packets
    costs one timeout, not one per task. Daemon threads, not a thread pool: a caller may stop
    waiting for them (dtf.providers.route.check_reach's direct probes), and the interpreter's exit joins a
    pool's workers (a dropped connection would keep `dtf up` alive DIRECT_PROBE seconds after its
    last line). A probe's exception is raised here, as a pool's map would."""
    answers: list[bool] = [False] * len(tasks)
    errors: list[Exception] = []
    left = iter(range(len(tasks)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(left, None)
            if i is None:
                return
            try:
                answers[i] = probe(tasks[i])
            except Exception as e:  # (raised in the caller's thread)
                errors.append(e)
                return

    threads = [threading.Thread(target=work, name="dtf-probe", daemon=True)
               for _ in range(min(PROBES_AT_ONCE, len(tasks)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return answers


PUMP_IDLE = 60.0  # seconds between two looks at a quiet connection (it stays open)


def pump(a: socket.socket, b: Any) -> None:
    """Copy both ways until either side closes: `b` a socket, or anything with recv, sendall,
    close and a fileno (a paramiko channel). (The Slurm login host's relay has its own copy: it
    travels as one file's text, dtf.providers.slurm.scripts.relay.)"""
    try:
        while True:
            ready, _, _ = select.select([a, b], [], [], PUMP_IDLE)
            for source, sink in ((a, b), (b, a)):
                if source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    sink.sendall(data)
    except OSError:
        pass
    finally:
        a.close()
        b.close()
