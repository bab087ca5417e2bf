"""The launcher's network command `reach` (the mesh check: can this host open a TCP connection
to the other hosts' tasks). `start --reach` runs the same mesh check once its own servers serve,
and `start --firewall` sets the TF ports' firewall rules first (dtf_server.start, dtf_server.firewall)."""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from typing import Any

from dtf_server.protocol import ReachReply, ReachRequest
from dtf_server.supervisor import renew

# Connection attempts per second a host's mesh check makes at most while other hosts' tasks refuse
# (`reach(again=True)`): each target is tried every len(targets) / REACH_RATE seconds, at least
# every REACH_PAUSE. Every host checks every other host's tasks while they start, so a refused
# target is not tried again at once; a few targets are tried as often as a start looks at its own
# servers (a Slurm node's check of the other node must not see its server late).
REACH_RATE = 100.0
REACH_PAUSE = 0.01
REACH_AT_ONCE = 256  # connections a mesh check has open at once


def reach(targets: list[str], timeout: float, again: bool = False) -> dict[str, str]:
    """Open a TCP connection to each target ("ADDR:PORT"), all at once (up to REACH_AT_ONCE: a host
    checks 99 others in one connect time), each within `timeout` seconds; the targets it could not
    connect to, with the reason. `again`: a refused connection is tried again until the time is up
    (`up`'s mesh check from a host whose servers serve while the other hosts may still be starting
    theirs; the laptop asks again what is missed once every host serves).

    In one thread, every connection non-blocking and watched by poll(2): every host checks every
    other host's tasks at once."""
    deadline = time.monotonic() + timeout
    pause = max(REACH_PAUSE, len(targets) / REACH_RATE)
    why: dict[str, str] = {}  # a target's last reason: what the time running out during its next try says
    reached: set[str] = set()
    settled: set[str] = set()  # reached, or not tried again
    next_try = dict.fromkeys(targets, 0.0)
    flight: dict[int, tuple[socket.socket, str]] = {}
    poller = select.poll()

    def failed(target: str, reason: str) -> None:
        why[target] = reason
        if again and deadline - time.monotonic() >= pause:
            next_try[target] = time.monotonic() + pause
        else:
            settled.add(target)

    def settle(target: str, code: int) -> None:
        if code == 0:
            reached.add(target)
            settled.add(target)
        else:
            failed(target, os.strerror(code))

    while len(settled) < len(targets):
        now = time.monotonic()
        flying = {target for _, target in flight.values()}  # (and those this pass leaves in flight)
        for target in targets:
            if (target in settled or target in flying or next_try[target] > now
                    or len(flight) >= REACH_AT_ONCE):
                continue
            host, _, port = target.rpartition(":")
            try:
                family, kind, proto, _, address = socket.getaddrinfo(
                    host.strip("[]"), int(port), 0, socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
            except (OSError, ValueError) as e:
                failed(target, getattr(e, "strerror", None) or str(e))
                continue
            sock.setblocking(False)
            code = connect(sock, address)
            if code == errno.EINPROGRESS:
                flight[sock.fileno()] = (sock, target)
                flying.add(target)
                poller.register(sock.fileno(), select.POLLOUT)
            else:
                sock.close()
                settle(target, code)
        if len(settled) == len(targets) or now >= deadline:
            break
        wake = deadline  # the next try due (one waits for a connection to end where REACH_AT_ONCE are open)
        if len(flight) < REACH_AT_ONCE:
            wake = min([next_try[t] for t in targets if t not in settled and t not in flying] + [deadline])
        for fd, _ in poller.poll(max(0, int(-(-(wake - time.monotonic()) * 1000 // 1)))):
            sock, target = flight.pop(fd)
            poller.unregister(fd)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            sock.close()
            settle(target, code)
    for sock, _ in flight.values():
        sock.close()
    return {t: why.get(t) or f"no answer within {timeout:g}s" for t in targets if t not in reached}


def connect(sock: socket.socket, address: Any) -> int:
    """Begin a non-blocking connect: 0 (connected), EINPROGRESS, or why not (an errno)."""
    return sock.connect_ex(address)


def cmd_reach(request: ReachRequest) -> ReachReply:
    """Open a TCP connection to each target (in parallel), each within --timeout seconds."""
    unreachable = reach(request.to, request.timeout)
    if request.dir:
        renew(request.dir, None)  # `up` asks last: whoever asks is using the cluster
    return ReachReply(unreachable=unreachable)
