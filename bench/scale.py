"""Control at scale on the SSH lab, fake servers: prints, asserts nothing.

    sudo .venv/bin/python bench/scale.py [--hosts 3,10,30,100] [--repeat 1] [--bastion] [--profile] [--kex ALG]

One lab of as many hosts as the largest count; for each count N, a cluster of one task per host
(h0 the ps, the others workers) on the first N hosts, and in one run:
- the floor: one `ssh HOST PYTHON -c pass` per host, all at once (a handshake and a python each),
  straight to the hosts; PYTHON is the hosts' python, the one dtf's launcher and servers run on:
  this script's own, which is dtf as a user installs it (common.as_installed: run from the
  checkout's development environment, the script runs again under a python without that
  environment's editable-install hook, 28 ms of every python's start);
- `dtf up`, `dtf status`, `dtf down` with DTF_SERVER=fake (no TensorFlow), each against the floor.
  With `--repeat` 2 or more, the first `up` of each inventory and the others are apart.
With `--bastion`, every host is reached through one ProxyJump host whose sshd keeps OpenSSH's
defaults (MaxStartups 10:30:100); the floor through it (ssh's own ProxyJump: one connection to
the bastion per host) is printed too, with how many of its ssh commands the bastion dropped.
The hosts' sshds share this machine's cores with dtf, so the floor grows with N here.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, as_installed  # (puts tests/ on the path)
from helpers import dtf
from lab import Lab


def floor(lab: Lab, hosts: list[str], config: Path, *options: str) -> tuple[float, int]:
    """Seconds for one `ssh HOST PYTHON -c pass` per host (the hosts' python: the inventory's, as dtf
    runs its launcher with), all started at once, and how many failed."""
    t0 = time.monotonic()
    procs = [subprocess.Popen(["ssh", "-F", str(config), "-i", str(lab.key), "-o", "BatchMode=yes", *options, h,
                               sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in hosts]
    failed = 0
    for p in procs:
        p.communicate(timeout=300)
        failed += p.returncode != 0
    return time.monotonic() - t0, failed


def direct_floor(lab: Lab, hosts: list[str], bastion: bool) -> float:
    """The floor, straight to the hosts (with a bastion: the same ssh through it is printed too, and
    fails for the hosts its sshd drops past MaxStartups)."""
    if bastion:
        seconds, failed = floor(lab, hosts, lab.ssh_config)
        print(f"  floor through the bastion (ssh's own ProxyJump), {len(hosts)} hosts: {seconds:.2f} s, "
              f"{failed} failed", flush=True)
    seconds, failed = floor(lab, hosts, lab.ssh_config, "-o", "ProxyJump=none")
    if failed:
        raise SystemExit(f"the floor failed on {failed} hosts")
    return seconds


class Failed(Exception):
    pass


def profiled_up(inv: Path, home: Path) -> float:
    """`dtf up` with its per-host progress lines (stderr, one line per step off a terminal) timed as
    they come: prints where the time went (the CLI's start, each step's median and slowest host,
    the end after the last host) and returns the seconds."""
    env = {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", "DTF_SERVER": "fake"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "up", str(inv)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert proc.stderr is not None
    seen: list[tuple[float, str, str]] = []  # (seconds since the start, host, step)
    for line in proc.stderr:
        m = re.match(r"^  (\S+): (.*)$", line.rstrip("\n"))
        if m:
            seen.append((time.monotonic() - t0, m.group(1), m.group(2)))
    code = proc.wait()
    total = time.monotonic() - t0
    if code != 0:
        raise Failed(f"dtf up failed after {total:.1f}s")
    spans: dict[str, list[float]] = collections.defaultdict(list)
    last: dict[str, tuple[float, str]] = {}
    for at, host, step in seen:
        if host in last:
            began, what = last[host]
            spans[re.sub(r"\d+", "N", what)].append(at - began)
        last[host] = (at, step)
    first = min((at for at, _, _ in seen), default=total)
    done = max((at for at, _, _ in seen), default=total)
    print(f"    up {total:.2f} s: first progress line at {first:.2f} s (the CLI's start and plan), "
          f"last at {done:.2f} s, exit {total - done:.2f} s after it", flush=True)
    for what, xs in spans.items():
        print(f"    {what[:70]:70s} n={len(xs):3d} median {statistics.median(xs):6.2f} s  max {max(xs):6.2f} s",
              flush=True)
    return total


def timed(*args: str, home: Path) -> float:
    """Seconds `dtf ARGS` took; Failed (with dtf's first lines) if it failed."""
    t0 = time.monotonic()
    r = dtf(*args, home=home, timeout=900, env={"DTF_SERVER": "fake"})
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        lines = lines[next((i for i, s in enumerate(lines) if s.startswith("dtf: error")), 0):]
        kinds = collections.Counter(re.sub(r"\d+", "N", line.split(": ", 1)[-1])[:70] for line in lines[1:])
        raise Failed(f"dtf {args[0]} failed after {time.monotonic() - t0:.1f}s: {lines[0] if lines else ''} "
                     + "; ".join(f"{n} x {kind}" for kind, n in kinds.most_common(4)))
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="3,10,30,100", help="host counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--bastion", action="store_true", help="every host behind one ProxyJump host")
    ap.add_argument("--profile", action="store_true", help="print where `up`'s time went, per step")
    ap.add_argument("--kex", help="a KexAlgorithms for every host in the lab's ssh_config: the floor's and dtf's "
                                  "(bench/ssh_kex.py: OpenSSH 9.0-9.8's default costs the client ~100 ms a handshake)")
    args = ap.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    extra = 1 if args.bastion else 0
    with tempfile.TemporaryDirectory() as tmp, Lab(max(counts) + extra, root=Path(tmp) / "lab",
                                                   bastion=args.bastion) as lab:
        home = Path(tmp) / "home"
        if args.kex:
            with open(lab.ssh_config, "a") as config:
                config.write(f"\nHost *\n  KexAlgorithms {args.kex}\n")
        names = [h.name for h in lab.hosts if h.name != lab.bastion_name]
        print(f"lab: {len(names)} hosts{' behind bastion ' + lab.bastion_name if args.bastion else ''}, "
              f"mode {lab.mode}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
              + (f", KexAlgorithms {args.kex}" if args.kex else ""))
        ports = lab.ports(1)
        rows = []
        for n in counts:
            inv = lab.inventory(Path(tmp) / f"n{n}.yaml", [
                {"host": h, **({"ps": ports} if i == 0 else {"workers": ports})}
                for i, h in enumerate(names[:n])], cluster=f"scale{n}")
            figs: dict[str, list[float]] = {k: [] for k in ("floor", "up", "status", "down", "up again")}
            for i in range(args.repeat):
                figs["floor"].append(direct_floor(lab, names[:n], args.bastion))
                try:
                    for what in ("up", "status", "down"):
                        if what == "up" and args.profile:
                            figs[what].append(profiled_up(inv, home))
                            continue
                        seconds = timed(*(["up", str(inv)] if what == "up" else [what]), home=home)
                        figs["up again" if what == "up" and i else what].append(seconds)
                except Failed as e:
                    print(f"  {n} hosts: {e}", flush=True)
                    dtf("down", home=home, timeout=900)  # whatever is left
                figs["floor"].append(direct_floor(lab, names[:n], args.bastion))
            rows.append((n, {k: statistics.median(v) if v else None for k, v in figs.items()}))
            print(f"  {n} hosts done (load {os.getloadavg()[0]:.1f}): "
                  + ", ".join(f"{k} {v}" for k, v in rows[-1][1].items()), flush=True)
        print("\n| hosts | floor | `dtf up` (first) | `dtf up` (again) | `dtf status` | `dtf down` |\n"
              "|---|---|---|---|---|---|")
        for n, m in rows:
            f = m["floor"]
            assert f is not None
            cells = [f"{v:.2f} s ({v / f:.2f}x)" if v is not None else "-"
                     for v in (m["up"], m["up again"], m["status"], m["down"])]
            print(f"| {n} | {f:.2f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    as_installed()
    main()
