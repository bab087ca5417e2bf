"""What the TF ports' firewall rules add to `dtf up` and `dtf down`, on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/firewall.py [--hosts 3,30] [--repeat 5] [--json FILE]

For each host count N (one lab of the largest N; a cluster of one task per host on the first N,
h0 the ps, fake servers: no TensorFlow), `up` then `down` with `firewall: off` and with
`firewall: auto` (the default: the lab's hosts are root, so each host's start sets an nftables
table before its server starts, and `down` removes it), taken in turns, `--repeat` times each.
Figures, the median of each: the wall time, and a host's CPU (each lab host's sshd and everything
it starts, in a control group of its own: bench/scale.py's Meter), with the difference auto - off.
The lab's hosts share this machine's cores: the wall time pays each host's CPU once per host.
First, the rules alone on one host: `apply`, `sweep` and `remove`, the median of 20.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, as_installed  # (puts tests/ on the path)
from cpugroups import CpuGroups
from lab import Lab
from scale import Figure, Meter, dtf, dtf_env

SETTINGS = ("off", "auto")
COMMANDS = ("up", "down")


def tables(lab: Lab, hosts: list[str]) -> int:
    """dtf's nftables tables on those hosts."""
    return sum(t.startswith("inet dtf_") for h in hosts for t in lab.tables(h))


def count(meter: Meter, names: list[str], n: int, repeat: int, tmp: Path) -> dict[str, dict[str, list[Figure]]]:
    lab = meter.lab
    hosts = names[:n]
    port = lab.ports(1)
    home = tmp / "home"
    runs: dict[str, dict[str, list[Figure]]] = {s: {c: [] for c in COMMANDS} for s in SETTINGS}
    for i in range(repeat):
        for setting in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            inv = lab.inventory(tmp / f"n{n}-{setting}.yaml",
                                [{"host": h, **({"ps": port} if j == 0 else {"workers": port})}
                                 for j, h in enumerate(hosts)], cluster=f"fw{n}")
            inv.write_text(inv.read_text() + f"firewall: {setting}\n")
            try:
                runs[setting]["up"].append(dtf(meter, hosts, ["up", str(inv)], home))
                rules = tables(lab, hosts)
                if rules != (n if setting == "auto" else 0):
                    raise SystemExit(f"firewall: {setting} on {n} hosts: {rules} dtf table(s) after up")
                runs[setting]["down"].append(dtf(meter, hosts, ["down"], home))
                if tables(lab, hosts):
                    raise SystemExit(f"firewall: {setting} on {n} hosts: dtf tables left after down")
            finally:
                subprocess.run([sys.executable, "-m", "dtf", "down"], env=dtf_env(home, True), cwd=REPO,
                               capture_output=True, timeout=900)  # (nothing, unless a run failed)
    return runs


# The rules alone, in one lab host's namespace: what a host's start (apply, then the sweep while
# its servers start) and its `clean` (remove) spend on them, in ms.
ALONE = """
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, {server!r})
from dtf_server import firewall
root = tempfile.mkdtemp(prefix="dtf-fw-bench-")
applied, swept, removed = [], [], []
for _ in range({times}):
    t0 = time.perf_counter()
    reply = firewall.apply(root, [{port}], ["10.0.0.1"])
    t1 = time.perf_counter()
    assert reply.error is None, reply.error
    firewall.sweep(root, lambda r: True)
    t2 = time.perf_counter()
    firewall.remove(root)
    applied.append(1000 * (t1 - t0))
    swept.append(1000 * (t2 - t1))
    removed.append(1000 * (time.perf_counter() - t2))
os.rmdir(root)
print(json.dumps({{"apply_ms": statistics.median(applied), "sweep_ms": statistics.median(swept),
                  "remove_ms": statistics.median(removed)}}))
"""


def alone(lab: Lab, times: int) -> dict[str, float]:
    code = ALONE.format(server=str(REPO / "server"), times=times, port=lab.ports(1)[0])
    r = lab.run(lab.hosts[0], [sys.executable, "-c", code], timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the rules alone failed: {r.stderr.strip()[-500:]}")
    figures: dict[str, float] = json.loads(r.stdout)
    return figures


def medians(figures: list[Figure]) -> dict[str, float]:
    return {"wall_s": statistics.median(f.wall_s for f in figures),
            "host_ms": statistics.median(1000 * statistics.mean(f.hosts_s) for f in figures),
            "laptop_ms": statistics.median(1000 * f.laptop_s for f in figures)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="3,30", help="host counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the figures to this file, as JSON")
    args = ap.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench/firewall.py needs root: the SSH lab and the control groups it measures in")
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, Lab(max(counts), root=Path(tmp) / "lab") as lab, \
            CpuGroups() as groups:
        meter = Meter(groups, lab)
        names = [h.name for h in lab.hosts]
        print(f"lab: {len(names)} hosts, mode {lab.mode}, {os.cpu_count()} cores, "
              f"load {os.getloadavg()[0]:.1f}; medians of {args.repeat}", flush=True)
        rules = alone(lab, 20)
        result["alone"] = rules
        print(f"the rules alone on one host (nft, median of 20): apply {rules['apply_ms']:.0f} ms, the sweep "
              f"{rules['sweep_ms']:.0f} ms (while the servers start), remove {rules['remove_ms']:.0f} ms", flush=True)
        for n in counts:
            runs = count(meter, names, n, args.repeat, Path(tmp))
            figures = {s: {c: medians(runs[s][c]) for c in COMMANDS} for s in SETTINGS}
            result[str(n)] = figures
            for c in COMMANDS:
                off, auto = figures["off"][c], figures["auto"][c]
                print(f"{n:>3} hosts, {c:<4}: wall {off['wall_s']:.2f} s off, {auto['wall_s']:.2f} s auto "
                      f"({auto['wall_s'] - off['wall_s']:+.2f} s); a host's CPU {off['host_ms']:.0f} ms off, "
                      f"{auto['host_ms']:.0f} ms auto ({auto['host_ms'] - off['host_ms']:+.0f} ms); the laptop's "
                      f"CPU {off['laptop_ms']:.0f} ms off, {auto['laptop_ms']:.0f} ms auto", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\n(figures written to {args.json})")


if __name__ == "__main__":
    as_installed()
    main()
