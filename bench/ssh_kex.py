"""What one SSH handshake costs the laptop, by key exchange: prints, asserts nothing.

    sudo .venv/bin/python bench/ssh_kex.py [--repeat 10]

On a lab host (tests/lab.py): `ssh HOST true` with this machine's OpenSSH defaults, then with each
key exchange of `ssh -Q kex` that both ends offer, forced with `-o KexAlgorithms=...`: the client's
CPU (user and system, from the children's rusage) and the wall time, means of `--repeat` runs.
Every `dtf up` opens one master per host, so at 30 or 100 hosts the client's share is the laptop's
largest part of an `up` (docs/hosts-and-networks.md, "Many hosts: the key exchange"). OpenSSH 9.0
to 9.8 default to sntrup761x25519-sha512, a post-quantum hybrid whose key generation is slow in
OpenSSH's own code; 9.9 and later offer mlkem768x25519-sha256 first. dtf does not choose a key
exchange for you: it takes yours from ssh_config (`KexAlgorithms`, per host or `Host *`).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts tests/ on the path)
from lab import Lab


def handshake(argv: list[str], repeat: int) -> tuple[float, float, bool]:
    """(client CPU ms, wall ms, every run succeeded) of running argv `repeat` times."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    ok = True
    for _ in range(repeat):
        ok = subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=60).returncode == 0 and ok
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / repeat * 1000
    return cpu, (time.monotonic() - t0) / repeat * 1000, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    version = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    offered = subprocess.run(["ssh", "-Q", "kex"], capture_output=True, text=True).stdout.split()
    with tempfile.TemporaryDirectory() as tmp, Lab(1, root=Path(tmp) / "lab") as lab:
        base = ["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes"]
        host = lab.hosts[0].name
        verbose = subprocess.run([*base, "-v", host, "true"], capture_output=True, text=True).stderr
        default = next((line.split("algorithm:")[1].strip() for line in verbose.splitlines()
                        if "kex: algorithm:" in line), "?")
        print(f"{version}; one lab host, {args.repeat} runs each; the default key exchange: {default}")
        cpu, wall, _ = handshake([*base, host, "true"], args.repeat)
        print(f"  {'(default)':40s} client CPU {cpu:6.1f} ms   wall {wall:6.1f} ms")
        for kex in ("mlkem768x25519-sha256", "sntrup761x25519-sha512@openssh.com", "sntrup761x25519-sha512",
                    "curve25519-sha256", "ecdh-sha2-nistp256"):
            if kex not in offered:
                continue
            cpu, wall, ok = handshake([*base, "-o", f"KexAlgorithms={kex}", host, "true"], args.repeat)
            print(f"  {kex:40s} client CPU {cpu:6.1f} ms   wall {wall:6.1f} ms"
                  + ("" if ok else "   (refused: the host's sshd does not offer it)"))


if __name__ == "__main__":
    main()
