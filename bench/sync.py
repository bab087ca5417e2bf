"""`dtf sync` figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/sync.py [--repeat 3] [--mb 100]

On a cluster of fake servers on the lab's 3 hosts (no TensorFlow needed), with MB megabytes of
mixed random files (a few large, some medium, many small) in a laptop directory no host sees:
- `dtf sync` to the 3 hosts, each host's cache emptied first (cold)
- of which: hashing alone (dtf.files.sync.pack: list the files, sha256 of their tar)
- `dtf sync` again: every host has the hash, nothing is sent
- the floor: `tar c -C DATA . | ssh HOST tar x -C DEST` to the same 3 hosts at once
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from common import fmt
from dtf.files import sync
from helpers import dtf
from lab import Lab

FAKE = {"DTF_SERVER": "fake"}


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


def timed(*args: str, home: Path) -> float:
    t0 = time.monotonic()
    dtf(*args, home=home, check=True, env=FAKE, timeout=600)
    return time.monotonic() - t0


def tar_ssh(lab: Lab, data: Path) -> float:
    """`tar c | ssh host tar x` to every lab host at once (into a directory of that host's own):
    seconds until the last one is done."""
    t0 = time.monotonic()
    procs = []
    for h in lab.hosts:
        dest = f"{h.workdir}/floor-dest"
        remote = f"rm -rf {dest} && mkdir -p {dest} && tar x -C {dest}"
        tar = subprocess.Popen(["tar", "c", "-C", str(data), "."], stdout=subprocess.PIPE)
        ssh = subprocess.Popen(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes",
                                h.name, remote], stdin=tar.stdout)
        assert tar.stdout is not None
        tar.stdout.close()
        procs += [tar, ssh]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"failed: {p.args}")
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mb", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Lab(3, root=Path(tmp) / "lab") as lab:
        home = Path(tmp) / "home"
        data = lab.laptop_dir("bench-sync")
        files, size = make_data(data, args.mb)
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; data: {files} files, {size / 1e6:.0f} MB "
              f"(random, in a laptop directory no host sees)")
        ports = lab.ports(3)
        inv = lab.inventory(Path(tmp) / "three.yaml", [
            {"host": "h0", "ps": [ports[0]]}, {"host": "h1", "workers": [ports[1]]},
            {"host": "h2", "workers": [ports[2]]}])
        dtf("up", str(inv), home=home, check=True, env=FAKE)
        figures: dict[str, list[float]] = {k: [] for k in ("cold", "pack", "again", "floor")}
        try:
            for _ in range(args.repeat):
                for h in lab.hosts:
                    shutil.rmtree(Path(h.workdir, ".cache", "sync"), ignore_errors=True)
                figures["cold"].append(timed("sync", str(data), "--as", "bench", home=home))
                figures["again"].append(timed("sync", str(data), "--as", "bench", home=home))
                t0 = time.monotonic()
                sync.pack(data, "bench")
                figures["pack"].append(time.monotonic() - t0)
                figures["floor"].append(tar_ssh(lab, data))
        finally:
            dtf("down", home=home, env=FAKE)
        mb = size / 1e6
        print(f"dtf sync, cold, 3 hosts:              {fmt(figures['cold'])}  "
              f"({mb / min(figures['cold']):.0f} MB/s per host at best)")
        print(f"  of which hashing (list, tar, sha256):  {fmt(figures['pack'])}")
        print(f"dtf sync again (every host has it):   {fmt(figures['again'])}")
        print(f"floor: tar c | ssh host tar x, 3 hosts: {fmt(figures['floor'])}  "
              f"({mb / min(figures['floor']):.0f} MB/s per host at best)")


if __name__ == "__main__":
    main()
