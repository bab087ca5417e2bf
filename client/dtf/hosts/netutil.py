"""Small network helpers shared by the client: free ports, TCP probes with deadlines."""

from __future__ import annotations

import socket
import time

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
