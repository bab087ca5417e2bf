"""`dtf sync` figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/sync.py [--hosts 3,10,30] [--repeat 1] [--mb 100] [--no-floor]

On a lab of as many hosts as the largest count (network namespaces: the bytes are counted), a
cluster of fake servers (no TensorFlow needed) on the first N hosts, for each N, and MB megabytes
of mixed random files (a few large, some medium, many small) in a laptop directory no host sees:
- `dtf sync` to the N hosts, each host's cache emptied first (cold): time, and the bytes out of
  the laptop (what this machine sent into the lab: the TX counter of the lab's bridge, the
  laptop's own port on it; traffic from host to host is forwarded by the bridge, not counted)
- `dtf sync` again: every host has the hash, nothing is sent
- the floor: `tar c -C DATA . | ssh HOST tar x -C DEST` to the same N hosts at once
- once: hashing alone (dtf.files.sync.pack: list the files, sha256 of their tar)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from common import fmt as fmt_all
from dtf.files import sync
from helpers import dtf
from lab import Lab

FAKE = {"DTF_SERVER": "fake"}
T = TypeVar("T")


def fmt(xs: list[float]) -> str:
    return f"{xs[0]:.2f}s" if len(xs) == 1 else fmt_all(xs)


def make_data(root: Path, megabytes: int) -> tuple[int, int]:
    """About `megabytes` MB of random files: 40% in 2 large files, 30% in 100 KB files, 30% in
    10 KB files. (files, bytes)."""
    total = megabytes * 10**6
    sizes = [int(total * 0.2)] * 2 + [100_000] * int(total * 0.3 / 100_000) + [10_000] * int(total * 0.3 / 10_000)
    for i, size in enumerate(sizes):
        path = root / f"d{i % 16}" / f"f{i}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
    return len(sizes), sum(sizes)


def measured(lab: Lab, fn: Callable[[], T]) -> tuple[float, int, T]:
    """(seconds, bytes out of the laptop, what it returned) of fn()."""
    b0, t0 = lab.laptop_bytes(), time.monotonic()
    result = fn()
    return time.monotonic() - t0, lab.laptop_bytes() - b0, result


def tar_ssh(lab: Lab, data: Path, n: int) -> None:
    """`tar c | ssh host tar x` to the first n lab hosts at once (into a directory of each host's own)."""
    procs = []
    for h in lab.hosts[:n]:
        dest = f"{h.workdir}/floor-dest"
        remote = f"rm -rf {dest} && mkdir -p {dest} && tar x -C {dest} && rm -rf {dest}"
        tar = subprocess.Popen(["tar", "c", "-C", str(data), "."], stdout=subprocess.PIPE)
        ssh = subprocess.Popen(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes",
                                h.name, remote], stdin=tar.stdout)
        assert tar.stdout is not None
        tar.stdout.close()
        procs += [tar, ssh]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"failed: {p.args}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="3,10,30", help="host counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--no-floor", action="store_true", help="skip tar | ssh (it sends N times the data)")
    args = ap.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    with tempfile.TemporaryDirectory() as tmp, Lab(max(counts), root=Path(tmp) / "lab", mode="netns") as lab:
        data = lab.laptop_dir("bench-sync")
        files, size = make_data(data, args.mb)
        mb = size / 1e6
        t0 = time.monotonic()
        sync.pack(data, "bench")
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; data: {files} files, {mb:.0f} MB "
              f"(random, in a laptop directory no host sees); hashing alone {time.monotonic() - t0:.2f}s")
        print("| hosts | dtf sync cold | MB out of the laptop | x data | sync again | floor tar|ssh | floor MB out |")
        print("|---|---|---|---|---|---|---|")
        for n in counts:
            home = Path(tmp) / f"home{n}"
            ports = lab.ports(n)
            inv = lab.inventory(Path(tmp) / f"n{n}.yaml", [
                {"host": h.name, ("ps" if i == 0 else "workers"): [ports[i]]} for i, h in enumerate(lab.hosts[:n])])
            dtf("up", str(inv), home=home, check=True, env=FAKE, timeout=900)
            cold: list[float] = []
            again: list[float] = []
            floor: list[float] = []
            out: list[int] = []
            floor_out: list[int] = []
            try:
                for _ in range(args.repeat):
                    for h in lab.hosts[:n]:
                        shutil.rmtree(Path(h.workdir, ".cache", "sync"), ignore_errors=True)
                    s, b, r = measured(lab, partial(dtf, "sync", str(data), "--as", "bench", home=home, env=FAKE,
                                                    timeout=1800))
                    cold.append(s)
                    out.append(b)
                    if r.returncode != 0:  # a figure too: say how it failed, and go on
                        errors = [line for line in r.stderr.splitlines() if line.strip()]
                        print(f"  {n} hosts: dtf sync failed after {s:.1f}s, {b / 1e6:.0f} MB out: "
                              + " / ".join(errors[-4:]), flush=True)
                    again.append(measured(lab, partial(dtf, "sync", str(data), "--as", "bench", home=home,
                                                       env=FAKE))[0])
                    if not args.no_floor:
                        s, b, _ = measured(lab, partial(tar_ssh, lab, data, n))
                        floor.append(s)
                        floor_out.append(b)
            finally:
                dtf("down", home=home, env=FAKE, timeout=900)
            print(f"| {n} | {fmt(cold)} | {max(out) / 1e6:.0f} | {max(out) / size:.2f} | {fmt(again)} | "
                  + (f"{fmt(floor)} | {max(floor_out) / 1e6:.0f} |" if floor else "- | - |"), flush=True)


if __name__ == "__main__":
    main()
