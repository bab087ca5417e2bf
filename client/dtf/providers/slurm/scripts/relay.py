"""A small TCP relay that `dtf train` runs on a Slurm cluster's login host: the tasks on the
compute nodes reach the coordinator (on the laptop) through it.

Why: in ssh network mode a task calls the coordinator back (the ps does while a checkpoint is
written through it) at 127.0.0.1:PORT on its own host, a remote forward (`ssh -R`) of that host's
SSH connection. On Slurm the tasks run on compute nodes that dtf never reaches by SSH; only the
login host has an SSH connection from the laptop, and its sshd binds a remote forward to its
loopback only (any other address needs `GatewayPorts`, which sites leave off). So the login host
runs this relay: it listens on the login host's address as the nodes reach it (the source address
of its route toward them), at the chief's port, and carries each connection to 127.0.0.1:PORT
there, the remote forward, which SSH carries on to the laptop. The cluster spec names the chief
at that address. Only the allocation's nodes may connect (anyone reaching the coordinator's port
can run code on the laptop): a connection from any other address is closed at once.

It runs in the SSH session that starts it (`python3 -c SOURCE ...` over the login host's master):
it prints the address it listens on (its readiness signal), and exits when its stdin closes (the
session ends with `dtf train`, or its master) or on any error at start. Standard library only,
one file, Python 3.8+: it is sent as the command's text, nothing is installed.

Bytes are copied in Python: the traffic back to the coordinator is small (a checkpoint's tensors
while it is written), unlike the laptop's traffic to the tasks, which OpenSSH carries.

    python3 -c SOURCE PORT TARGET_PORT NODE_ADDRESS [NODE_ADDRESS ...]
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
from typing import Any

CONNECT_TIMEOUT = 10.0  # seconds for the connection to the remote forward
IDLE = 60.0  # seconds between two looks at a quiet connection (it stays open)


def facing(address: str) -> str:
    """This host's own address on its route toward `address` (no packet is sent: a UDP connect
    only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def pump(a: socket.socket, b: Any) -> None:
    """Copy both ways until either side closes: `b` a socket, or anything with recv, sendall,
    close and a fileno (a paramiko channel)."""
    try:
        while True:
            ready, _, _ = select.select([a, b], [], [], IDLE)
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


def serve(listener: socket.socket, target: tuple[str, int], allowed: set[str]) -> None:
    while True:
        conn, peer = listener.accept()
        if peer[0] not in allowed:
            conn.close()
            continue
        try:
            upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT)
        except OSError:
            conn.close()
            continue
        upstream.settimeout(None)
        for s in (conn, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()


def main(argv: list[str]) -> int:
    port, target_port, nodes = int(argv[0]), int(argv[1]), argv[2:]
    try:
        address = facing(nodes[0])
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(64)
    except OSError as e:
        print(f"error: cannot listen at port {port} on the login host: {e}", flush=True)
        return 1
    threading.Thread(target=serve, args=(listener, ("127.0.0.1", target_port), set(nodes)), daemon=True).start()
    print(f"listening {address}:{port}", flush=True)
    while os.read(0, 4096):
        pass  # the session's stdin: it closes when dtf train (or its SSH master) ends
    return 0  # (the copying threads are daemons: they end with the process)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
