"""Round trip of one small request through ssh mode's route, on the SSH lab: a server on a lab host
answers each 64-byte request in two writes 1 ms apart, as a TF task often does, and the laptop
times request to full reply. The routes: direct; `ssh -W` over dtf's master (`tunnel.Master`,
which runs one empty session first); over a master without that session (dtf before the fix);
and through a jump host (ProxyJump) with dtf's masters, and with ssh's own jump connection. An
sshd before OpenSSH 10.1 turns Nagle's algorithm off only when a session starts; with it on, the
second write waits for the laptop's delayed ACK.

    .venv/bin/python bench/tunnel_latency.py [--requests 300]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from common import REPO  # noqa: F401  (puts tests/ on the path)
from dtf.cluster.inventory import HostSpec
from dtf.hosts.masters import Master
from dtf.hosts.openssh import ssh_binary
from lab import Lab

PORT = 7070
SERVER = textwrap.dedent(f"""
    import socket, threading, time
    listener = socket.create_server(("0.0.0.0", {PORT}))
    def answer(c):
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while c.recv(64):
            c.sendall(b"a" * 40); time.sleep(0.001); c.sendall(b"b" * 40)
    while True:
        threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()
""")


def round_trips(sock: socket.socket, n: int) -> list[float]:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.sendall(b"x" * 64)
        got = 0
        while got < 80:
            got += len(sock.recv(100))
        times.append(time.perf_counter() - t0)
    return times


def through(master: Master, target: str, n: int) -> list[float]:
    """As dtf's proxy does: `ssh -W` over the master, a loopback TCP socket as its stdin/stdout."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        mine = socket.create_connection(listener.getsockname())
        theirs = listener.accept()[0]
    theirs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    child = subprocess.Popen(master.channel_argv(target), stdin=theirs.fileno(), stdout=theirs.fileno())
    theirs.close()
    try:
        return round_trips(mine, n)
    finally:
        mine.close()
        child.terminate()
        child.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    ssh = ssh_binary()
    assert ssh, "needs the OpenSSH client"
    with tempfile.TemporaryDirectory() as d, Lab(2, root=Path(d) / "lab", mode="netns") as lab:
        jump, host = lab.hosts
        config = Path(d) / "ssh_config"
        config.write_text(f"Host behind\n  HostName {host.address}\n  User root\n  ProxyJump {jump.name}\n"
                          f"  UserKnownHostsFile {lab.known_hosts}\n\nHost {jump.name}\n  IdentityFile {lab.key}\n\n"
                          + lab.ssh_config.read_text())
        server = subprocess.Popen(["ip", "netns", "exec", str(host.netns), sys.executable, "-c", SERVER])
        try:
            target = f"{host.address}:{PORT}"
            deadline = time.monotonic() + 20
            while True:
                try:
                    direct = socket.create_connection((host.address, PORT), timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the lab server did not start"
                    time.sleep(0.1)
            with direct:
                results = {"direct": round_trips(direct, args.requests)}
            spec = HostSpec(host=host.name, line=1, connection="ssh", user=None, port=None,
                            identity_file=str(lab.key), python=sys.executable, workdir="~", address=None,
                            ps_ports=(), worker_ports=())
            behind = replace(spec, host="behind")
            routes = [("ssh, dtf's master", spec, True, True), ("ssh, master without a session", spec, False, True),
                      ("ssh via jump, dtf's masters", behind, True, True),
                      ("ssh via jump, ssh's own jump", behind, True, False)]
            for i, (label, to, session, hops) in enumerate(routes):
                master = Master(ssh, to, str(config), str(Path(d) / f"m{i}"))
                if not session:
                    master._session = lambda: None  # type: ignore[method-assign]  # dtf before
                if not hops:
                    master.jumps = lambda: []  # type: ignore[method-assign]  # ssh's ProxyJump
                master.start()
                try:
                    results[label] = through(master, target, args.requests)
                    print(f"{label}: TCP_NODELAY of the jump host's sshd {lab.sshd_nodelay(jump)}, "
                          f"of the host's {lab.sshd_nodelay(host)}")
                finally:
                    master.stop()
        finally:
            server.kill()
    print(f"\nround trip of a 64-byte request and a reply in two writes ({args.requests} requests)")
    for label, times in results.items():
        ms = sorted(t * 1e3 for t in times)
        print(f"{label:<32} median {statistics.median(ms):7.2f} ms   p90 {ms[int(0.9 * len(ms))]:7.2f} ms")


if __name__ == "__main__":
    main()
