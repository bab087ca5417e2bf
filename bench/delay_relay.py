"""A WAN in user space: `delay_relay.py HOST PORT DELAY_MS` connects to HOST:PORT and relays
stdin/stdout to it, holding every chunk DELAY_MS milliseconds in each direction (the kernels here
have no netem). Used as an ssh ProxyCommand by bench/network.py."""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time


def delayed(read, write, delay: float) -> None:  # type: ignore[no-untyped-def]
    """Copy chunks from read() to write(), each `delay` seconds after it was read; b"" ends it."""
    held: queue.Queue[tuple[float, bytes]] = queue.Queue()

    def sender() -> None:
        while True:
            due, data = held.get()
            time.sleep(max(0.0, due - time.monotonic()))
            write(data)
            if not data:
                return

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    while True:
        data = read()
        held.put((time.monotonic() + delay, data))
        if not data:
            break
    thread.join()


def main() -> None:
    host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1000
    sock = socket.create_connection((host, port), timeout=10)
    sock.settimeout(None)

    def to_host(data: bytes) -> None:
        if data:
            sock.sendall(data)
        else:
            sock.shutdown(socket.SHUT_WR)

    def to_ssh(data: bytes) -> None:
        if data:
            os.write(1, data)
        else:
            os.close(1)

    up = threading.Thread(target=delayed, args=(lambda: os.read(0, 65536), to_host, delay), daemon=True)
    up.start()
    delayed(lambda: sock.recv(65536), to_ssh, delay)
    up.join(timeout=1)


if __name__ == "__main__":
    main()
