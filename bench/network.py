"""Steps/s in direct and in ssh network mode, at 1, 10 and 100 steps per closure, on the SSH lab
(3 hosts: 1 ps, 2 workers; examples/custom_loop.py), and in ssh mode through an emulated WAN
round trip (these kernels have no netem: every SSH connection goes through a user-space relay
that holds each chunk DELAY ms each way, as the hosts' ProxyCommand). Also `up` and `down` times.

    sudo .venv/bin/python bench/network.py [--delay-ms 12] [--steps 200]

Steps/s is measured between the end of epoch 1 and the end of epoch 3 (start-up excluded).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import REPO
from helpers import Train, dtf
from lab import Lab

RELAY = Path(__file__).resolve().parent / "delay_relay.py"


def run(home: Path, tag: str, per_call: int, steps: int, tmp: Path) -> float:
    """Steps/s of one `dtf train` (its own output directory: nothing to resume)."""
    run = Train(home, tmp / f"{tag}-{per_call}.out", "--output", str(tmp / f"out-{tag}-{per_call}"),
                str(REPO / "examples" / "custom_loop.py"), "--epochs", "3", "--steps-per-epoch", str(steps),
                "--steps-per-call", str(per_call))
    t1 = run.wait_for(r"^epoch 1/3 done", timeout=600)
    t3 = run.wait_for(r"^epoch 3/3 done", timeout=1200)
    code, text = run.finish(timeout=120)
    assert code == 0, text[-3000:]
    return 2 * steps / (t3 - t1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=12.0, help="added each way (12: a 24 ms round trip)")
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch (a multiple of 100)")
    parser.add_argument("--packing", default="1,10,100")
    args = parser.parse_args()
    packings = [int(p) for p in args.packing.split(",")]
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        ps, w0, w1 = lab.ports(3)
        hosts = [{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}, {"host": "h2", "workers": [w1]}]
        table: dict[str, list[float]] = {}
        wan = lab.root / "ssh_config_wan"
        wan.write_text(lab.ssh_config.read_text().replace(
            "  User root\n", f"  User root\n  ProxyCommand {sys.executable} {RELAY} %h %p {args.delay_ms:g}\n"))
        for label, network, config in [("direct", "direct", lab.ssh_config), ("ssh", "ssh", lab.ssh_config),
                                       (f"ssh +{2 * args.delay_ms:g}ms RTT", "ssh", wan)]:
            home = tmp / f"home-{len(table)}"
            inv = lab.inventory(tmp / f"inv-{len(table)}.yaml", hosts)
            inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
            t0 = time.monotonic()
            r = dtf("up", str(inv), "--network", network, home=home, timeout=300)
            up_s = time.monotonic() - t0
            assert r.returncode == 0, r.stderr
            table[label] = [run(home, f"mode{len(table)}", p, args.steps, tmp) for p in packings]
            t0 = time.monotonic()
            assert dtf("down", home=home, timeout=300).returncode == 0
            print(f"{label:<18} up {up_s:5.1f}s  down {time.monotonic() - t0:4.1f}s", flush=True)
        print(f"\nsteps/s (custom_loop, 1 ps + 2 workers, {args.steps} steps per epoch)")
        print(f"{'mode':<18}" + "".join(f"{f'{p}/closure':>14}" for p in packings))
        for label, rates in table.items():
            print(f"{label:<18}" + "".join(f"{r:14.1f}" for r in rates))
        ratio = [s / d for s, d in zip(table["ssh"], table["direct"])]
        print(f"{'ssh / direct':<18}" + "".join(f"{r:13.2f}x" for r in ratio))


if __name__ == "__main__":
    main()
