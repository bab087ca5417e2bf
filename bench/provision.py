"""Provisioning figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/provision.py [--repeat 3]

- `dtf up` wall time for 1 and for 3 lab hosts (2 tasks on 1 host; 1 ps + 2 workers on 3 hosts)
- the floor: `ssh HOST python -c 'import tensorflow'` on one host, and on the 3 hosts at once;
  and the lean floor: the same with the server's own import (dtf_server.tfserve: only TensorFlow's
  server module), on the 3 hosts at once
- `dtf status` (3 hosts), `dtf down` wall time, `dtf --help` wall time
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, fmt
from helpers import dtf
from lab import Lab


def timed(*args: str, home: Path) -> float:
    """Seconds `dtf ARGS` took (it must succeed)."""
    t0 = time.monotonic()
    dtf(*args, home=home, check=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Lab(3, root=Path(tmp) / "lab") as lab:
        home = Path(tmp) / "home"
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; python {sys.executable}")
        ports = lab.ports(3)
        one = lab.inventory(Path(tmp) / "one.yaml", [{"host": "h0", "ps": [ports[0]], "workers": [ports[1]]}])
        three = lab.inventory(Path(tmp) / "three.yaml", [
            {"host": "h0", "ps": [ports[0]]}, {"host": "h1", "workers": [ports[1]]},
            {"host": "h2", "workers": [ports[2]]}])
        figures: dict[str, list[float]] = {k: [] for k in ("up1", "up3", "status3", "down1", "down3", "floor",
                                                           "floor3", "lean3", "help")}
        lean = (f"'import sys; sys.path.insert(0, \"{REPO / 'server'}\"); "
                "from dtf_server.tfserve import server_lib; server_lib()'")

        def floor(hosts: list[str], code: str = "'import tensorflow'") -> float:
            t0 = time.monotonic()
            procs = [subprocess.Popen(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), h, sys.executable, "-c",
                                       code], stdin=subprocess.DEVNULL) for h in hosts]
            for p in procs:
                if p.wait(timeout=300) != 0:
                    raise SystemExit(f"the floor failed: {p.args}")
            return time.monotonic() - t0

        for _ in range(args.repeat):
            figures["up1"].append(timed("up", str(one), home=home))
            figures["down1"].append(timed("down", home=home))
            figures["floor3"].append(floor(["h0", "h1", "h2"]))
            figures["lean3"].append(floor(["h0", "h1", "h2"], lean))
            figures["up3"].append(timed("up", str(three), home=home))
            figures["status3"].append(timed("status", home=home))
            figures["down3"].append(timed("down", home=home))
            figures["floor"].append(floor(["h1"]))
            figures["help"].append(timed("--help", home=home))
        print(f"dtf up, 1 host (2 tasks):            {fmt(figures['up1'])}")
        print(f"dtf up, 3 hosts (3 tasks):           {fmt(figures['up3'])}")
        print(f"floor: ssh host python -c 'import tensorflow': {fmt(figures['floor'])}")
        print(f"floor, the 3 hosts at once:          {fmt(figures['floor3'])}")
        print(f"lean floor, the 3 hosts at once:     {fmt(figures['lean3'])}")
        print(f"dtf status, 3 hosts:                 {fmt(figures['status3'])}")
        print(f"dtf down, 1 host:                    {fmt(figures['down1'])}")
        print(f"dtf down, 3 hosts:                   {fmt(figures['down3'])}")
        print(f"dtf --help:                          {fmt(figures['help'])}")


if __name__ == "__main__":
    main()
