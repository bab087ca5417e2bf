"""What `dtf train`'s repair costs while a run goes on, on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/repair.py [--hosts 3,30] [--seconds 60] [--dtf DIR] [--json FILE]

For each host count N (one lab of the largest N; a cluster of one fake server per host on the
first N, h0 the ps: no TensorFlow), `dtf up`, then two windows of `--seconds` each, measured as
bench/scale.py measures (its Meter: the laptop's control group, and one per lab host holding its
sshd and all it starts):

1. idle: the cluster up, nothing running on the laptop (the hosts' own floor: supervisors and
   fake servers);
2. train: `dtf train` of a program that only sleeps (so what runs is dtf's watch of the hosts:
   the repair, the lease keeper), from a few seconds after the program started.

Printed per minute: the laptop's CPU per host, and a host's CPU (median and slowest host), for
both windows; the train window less the idle one is what the watch costs a host.

`--dtf DIR`: run the dtf of another checkout (its client/ and server/ first on PYTHONPATH, so
the launcher and the servers its `up` ships are that checkout's too), e.g. one made with
`git archive COMMIT | tar -x -C DIR`, to compare two versions on the same lab.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, as_installed  # (puts tests/ on the path)
from cpugroups import CpuGroups
from lab import Lab
from scale import Figure, Meter

SETTLE_S = 10.0  # after the program started: the repair's first connections are made


def env(home: Path, other: Path | None) -> dict[str, str]:
    extra = {"PYTHONPATH": f"{other / 'client'}:{other / 'server'}"} if other else {}
    return {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", "DTF_SERVER": "fake", **extra}


def run_dtf(args: list[str], home: Path, other: Path | None, timeout: float = 900) -> None:
    r = subprocess.run([sys.executable, "-m", "dtf", *args], env=env(home, other), cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"dtf {args[0]} failed: {r.stderr.strip()[-2000:]}")


def per_minute(figure: Figure, seconds: float) -> dict[str, float]:
    scale = 60.0 / seconds
    return {"laptop_ms_per_host_per_min": figure.laptop_ms_per_host() * scale,
            "host_ms_per_min": figure.host_ms() * scale, "host_max_ms_per_min": figure.host_max_ms() * scale}


def one_count(meter: Meter, hosts: list[str], seconds: float, tmp: Path, other: Path | None) -> dict[str, dict]:
    lab, home = meter.lab, tmp / f"home{len(hosts)}"
    ports = lab.ports(1)
    inv = lab.inventory(tmp / f"n{len(hosts)}.yaml",
                        [{"host": h, **({"ps": ports} if i == 0 else {"workers": ports})} for i, h in enumerate(hosts)],
                        cluster=f"repair{len(hosts)}")
    program = tmp / "sleeps.py"
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(3600)\n")
    run_dtf(["up", str(inv)], home, other)
    out: dict[str, dict] = {}
    try:
        out["idle"] = per_minute(meter.measure(hosts, lambda: time.sleep(seconds)), seconds)
        log = tmp / f"train{len(hosts)}.out"
        with open(log, "w") as f:
            train = meter.popen([sys.executable, "-m", "dtf", "train", str(program)], stdout=f,
                                stderr=subprocess.STDOUT, env=env(home, other), cwd=REPO)
        try:
            deadline = time.monotonic() + 600
            while "started" not in log.read_text():
                if train.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"dtf train did not start the program: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            time.sleep(SETTLE_S)
            out["train"] = per_minute(meter.measure(hosts, lambda: time.sleep(seconds)), seconds)
        finally:
            train.send_signal(signal.SIGINT)
            try:
                train.wait(timeout=120)
            except subprocess.TimeoutExpired:
                train.kill()
                train.wait()
    finally:
        run_dtf(["down"], home, other)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="3,30", help="host counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0, help="each window's length")
    ap.add_argument("--dtf", type=Path, help="the checkout whose dtf runs (default: this one)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file, as JSON")
    args = ap.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench/repair.py needs root: the SSH lab and the control groups it measures in")
    other = args.dtf.resolve() if args.dtf else None
    with tempfile.TemporaryDirectory() as tmp, Lab(max(counts), root=Path(tmp) / "lab", pick=True) as lab, \
            CpuGroups() as groups:
        meter = Meter(groups, lab)
        names = [h.name for h in lab.hosts]
        print(f"lab: {len(names)} hosts, mode {lab.mode}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
              f"dtf from {other or REPO}; windows of {args.seconds:g}s", flush=True)
        result: dict[str, object] = {"dtf": str(other or REPO), "seconds": args.seconds, "counts": {}}
        print("| hosts | window | laptop CPU per host per minute | a host's CPU per minute (slowest) |\n"
              "|---|---|---|---|", flush=True)
        for n in counts:
            figures = one_count(meter, names[:n], args.seconds, Path(tmp), other)
            result["counts"][n] = figures  # type: ignore[index]
            for window, f in figures.items():
                print(f"| {n} | {window} | {f['laptop_ms_per_host_per_min']:.1f} ms | "
                      f"{f['host_ms_per_min']:.1f} ms ({f['host_max_ms_per_min']:.1f} ms) |", flush=True)
            if "train" in figures and "idle" in figures:
                extra = figures["train"]["host_ms_per_min"] - figures["idle"]["host_ms_per_min"]
                print(f"  {n} hosts: the watch costs a host {extra:.1f} ms a minute (median host, train - idle)",
                      flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
            print(f"\n(figures written to {args.json})")


if __name__ == "__main__":
    as_installed()
    main()
