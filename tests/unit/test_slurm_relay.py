"""The relay dtf runs on a Slurm login host (dtf.providers.slurm: scripts/relay.py), run here as dtf runs it there
(`python3 -c SOURCE`): it says where it listens, carries the nodes' connections to the target,
closes anyone else's, and exits when its stdin closes."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from dtf.hosts.netutil import free_ports
from dtf.providers.slurm.commands import script_text


def echo_server() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_relay_carries_the_nodes_connections_and_exits_with_its_stdin() -> None:
    target = echo_server()
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-c", script_text("relay.py"), str(port),
                             str(target.getsockname()[1]), "127.0.0.1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == f"listening 127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
        # from an address that is not a node's: closed unanswered
        with socket.socket() as c:
            c.settimeout(10)
            c.bind(("127.0.0.2", 0))
            c.connect(("127.0.0.1", port))
            assert c.recv(4) == b""
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        target.close()


def test_relay_says_why_it_cannot_listen() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", script_text("relay.py"), str(port), "1", "127.0.0.1"],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    busy.close()
    assert r.returncode == 1
    assert r.stdout.startswith(f"error: cannot listen at port {port} on the login host:"), r.stdout
