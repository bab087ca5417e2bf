"""Steps/s in direct and in ssh network mode, at 1, 10 and 100 steps per closure, on the SSH lab
(3 hosts: 1 ps, 2 workers; examples/custom_loop.py), and in ssh mode through an emulated WAN
round trip (these kernels have no netem: every SSH connection goes through a user-space relay
that holds each chunk DELAY ms each way, as the hosts' ProxyCommand). Also `up` and `down` times.

    sudo .venv/bin/python bench/network.py [--delay-ms 12] [--steps 200] [--repeats 3]

The three clusters (direct, ssh, ssh through the WAN relay) are up at once, on the same hosts at
other ports, and the runs are interleaved (direct, ssh, WAN at one packing, then the next
packing; all of it --repeats times), so a slow minute of a shared machine falls on every mode
alike. Each cell is the median of its runs; steps/s is measured between the end of epoch 1 and the
end of epoch 3 (start-up excluded).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, ps_and_two_workers
from helpers import Train, dtf
from lab import Lab

RELAY = Path(__file__).resolve().parent / "delay_relay.py"


def run(home: Path, tag: str, per_call: int, steps: int, tmp: Path) -> float:
    """Steps/s of one `dtf train` (its own output directory: nothing to resume)."""
    out = tmp / f"{tag}-{per_call}-{time.monotonic_ns()}"
    run = Train(home, Path(f"{out}.out"), "--output", str(out), str(REPO / "examples" / "custom_loop.py"),
                "--epochs", "3", "--steps-per-epoch", str(steps), "--steps-per-call", str(per_call))
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
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is shown)")
    args = parser.parse_args()
    packings = [int(p) for p in args.packing.split(",")]
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        wan = lab.root / "ssh_config_wan"
        wan.write_text(lab.ssh_config.read_text().replace(
            "  User root\n", f"  User root\n  ProxyCommand {sys.executable} {RELAY} %h %p {args.delay_ms:g}\n"))
        modes = [("direct", "direct", lab.ssh_config), ("ssh", "ssh", lab.ssh_config),
                 (f"ssh +{2 * args.delay_ms:g}ms RTT", "ssh", wan)]
        homes: dict[str, Path] = {}
        times: dict[str, tuple[float, float]] = {}
        for i, (label, network, config) in enumerate(modes):
            hosts = ps_and_two_workers(lab)
            home = homes[label] = tmp / f"home-{i}"
            inv = lab.inventory(tmp / f"inv-{i}.yaml", hosts, cluster=f"bench{i}")
            inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
            t0 = time.monotonic()
            dtf("up", str(inv), "--network", network, home=home, timeout=300, check=True)
            times[label] = (time.monotonic() - t0, 0.0)
        rates: dict[tuple[str, int], list[float]] = {}
        for rep in range(args.repeats):
            for p in packings:
                for i, (label, _, _) in enumerate(modes):
                    rate = run(homes[label], f"mode{i}", p, args.steps, tmp)
                    rates.setdefault((label, p), []).append(rate)
                    print(f"  run {rep + 1}/{args.repeats}  {label:<16} {p:>3}/closure  {rate:7.1f} steps/s",
                          flush=True)
        for label, _, _ in modes:
            t0 = time.monotonic()
            dtf("down", home=homes[label], timeout=300, check=True)
            times[label] = (times[label][0], time.monotonic() - t0)
        print()
        for label, (up_s, down_s) in times.items():
            print(f"{label:<18} up {up_s:5.1f}s  down {down_s:4.1f}s")
        print(f"\nsteps/s, median of {args.repeats} (custom_loop, 1 ps + 2 workers, {args.steps} steps per epoch)")
        print(f"{'mode':<18}" + "".join(f"{f'{p}/closure':>14}" for p in packings))
        med = {k: statistics.median(v) for k, v in rates.items()}
        for label, _, _ in modes:
            print(f"{label:<18}" + "".join(f"{med[label, p]:14.1f}" for p in packings))
        print(f"{'ssh / direct':<18}" + "".join(f"{med['ssh', p] / med['direct', p]:13.2f}x" for p in packings))
        spread = {k: (min(v), max(v)) for k, v in rates.items()}
        print("\nspread (min-max steps/s)")
        for label, _, _ in modes:
            print(f"{label:<18}" + "".join(f"{f'{spread[label, p][0]:.0f}-{spread[label, p][1]:.0f}':>14}"
                                            for p in packings))


if __name__ == "__main__":
    main()
