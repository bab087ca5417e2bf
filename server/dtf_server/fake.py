"""A fake server for tests: everything a supervisor and dtf see of a TensorFlow server, in
milliseconds and without TensorFlow.

It binds the task's port on 0.0.0.0 (SO_REUSEADDR, as gRPC does), accepts connections and echoes
what they send (so a test sees bytes travel to it and back), and writes the readiness file as
the real server does. It can be told to misbehave:
- a file `crash` in its task directory (its working directory), present at start or created
  later: it exits with code 3, as a server that cannot start or dies would;
- `--ready-delay S`: it binds and announces readiness only after S seconds (a slow import);
- `--ready-file F`: ... and only once the file F exists (a barrier a test releases: the server
  is still starting for as long as the test needs, however fast or slow the machine is);
- `--ignore-term`: it ignores SIGTERM, so only KILL stops it (a hung server).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time

from dtf_server.procs import write_json
from dtf_server.protocol import Layout

CRASH_CODE = 3
POLL = 0.1


def echo(conn: socket.socket, first: bytes) -> None:
    """Send back what the peer sends (`first`, what it sent first), until it closes (or 60 s of
    silence)."""
    conn.settimeout(60)
    try:
        data = first
        while data:
            conn.sendall(data)
            data = conn.recv(65536)
    except OSError:
        pass
    finally:
        conn.close()


def crash_requested() -> bool:
    return os.path.exists(Layout.CRASH)  # the supervisor runs servers in their task directory


def serve(job: str, index: int, port: int, ready: str, ready_delay: float = 0.0,
          ignore_term: bool = False, ready_file: str | None = None) -> None:
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deadline = time.monotonic() + ready_delay
    while time.monotonic() < deadline or (ready_file is not None and not os.path.exists(ready_file)):
        if crash_requested():
            break
        time.sleep(POLL)
    if crash_requested():
        print(f"fake {job}:{index}: crash requested: exiting with code {CRASH_CODE}", flush=True)
        sys.exit(CRASH_CODE)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(64)
    write_json(ready, {"pid": os.getpid(), "target": f"fake://localhost:{port}", "time": time.time()})
    print(f"dtf: {job}:{index} (fake) serving on port {port}", flush=True)
    # A connection gets a thread only once it sends something: most only connect and close (every
    # other host's mesh check, this machine's reach), as a TF server's gRPC takes them in its event loop.
    idle: dict[int, socket.socket] = {}  # connections that sent nothing yet, by descriptor
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while not crash_requested():
        for fd, _ in poller.poll(POLL * 1000):
            if fd == sock.fileno():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                idle[conn.fileno()] = conn
                poller.register(conn.fileno(), select.POLLIN)
                continue
            poller.unregister(fd)
            conn = idle.pop(fd)
            try:
                first = conn.recv(65536)
            except OSError:
                first = b""
            if first:
                threading.Thread(target=echo, args=(conn, first), daemon=True).start()
            else:
                conn.close()
    print(f"fake {job}:{index}: crash requested: exiting with code {CRASH_CODE}", flush=True)
    sys.exit(CRASH_CODE)
