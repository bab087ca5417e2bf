"""Provisioning figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/provision.py [--repeat 3]

- `dtf up` wall time for 1 and for 3 lab hosts (2 tasks on 1 host; 1 ps + 2 workers on 3 hosts)
- the floor: `ssh HOST python -c 'import tensorflow'` on the same lab
- `dtf down` wall time, `dtf --help` wall time
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from lab import Lab  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{r.stdout}\n{r.stderr}")
    return elapsed


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):6.2f}s  (min {min(xs):.2f}, max {max(xs):.2f}, n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dtf = [sys.executable, "-m", "dtf.cli"]
    with tempfile.TemporaryDirectory() as tmp, Lab(3, root=Path(tmp) / "lab") as lab:
        env = {**os.environ, "DTF_HOME": str(Path(tmp) / "home")}
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; python {sys.executable}")
        ports = lab.ports(3)
        one = lab.inventory(Path(tmp) / "one.yaml", [{"host": "h0", "ps": [ports[0]], "workers": [ports[1]]}])
        three = lab.inventory(Path(tmp) / "three.yaml", [
            {"host": "h0", "ps": [ports[0]]}, {"host": "h1", "workers": [ports[1]]},
            {"host": "h2", "workers": [ports[2]]}])
        figures: dict[str, list[float]] = {k: [] for k in ("up1", "up3", "down1", "down3", "floor", "help")}
        for _ in range(args.repeat):
            figures["up1"].append(timed([*dtf, "up", str(one)], env))
            figures["down1"].append(timed([*dtf, "down"], env))
            figures["up3"].append(timed([*dtf, "up", str(three)], env))
            figures["down3"].append(timed([*dtf, "down"], env))
            figures["floor"].append(timed(
                ["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "h1",
                 sys.executable, "-c", "'import tensorflow'"], env))
            figures["help"].append(timed([*dtf, "--help"], env))
        print(f"dtf up, 1 host (2 tasks):            {fmt(figures['up1'])}")
        print(f"dtf up, 3 hosts (3 tasks):           {fmt(figures['up3'])}")
        print(f"floor: ssh host python -c 'import tensorflow': {fmt(figures['floor'])}")
        print(f"dtf down, 1 host:                    {fmt(figures['down1'])}")
        print(f"dtf down, 3 hosts:                   {fmt(figures['down3'])}")
        print(f"dtf --help:                          {fmt(figures['help'])}")


if __name__ == "__main__":
    main()
