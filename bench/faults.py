"""Fault figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/faults.py [--repeat 3]

- worker death to serving again: SIGKILL a worker's server, time until its port accepts a
  connection from the laptop again (the supervisor restarted it on the same port)
- what a lost ps costs a run end to end: custom_loop (6 epochs of 40 steps) with no fault, and
  with ps:0 killed after epoch 2; the difference of the wall times
- lease lapse to host cleared: `dtf up --ttl 5s`, nothing renews; time from the lease's end
  (its `renewed + ttl`, read from the host) until no dtf process and no dtf file is left there
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, fmt
from dtf.hosts.netutil import port_open
from helpers import Train, dtf, status_json
from lab import Lab


class Dtf:
    """dtf with one DTF_HOME; every command must succeed."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def __call__(self, *args: str) -> None:
        dtf(*args, home=self.home, timeout=600, check=True)

    def row(self, task: str) -> dict[str, Any]:
        return next(r for r in status_json(self.home)["tasks"] if r["task"] == task)


def worker_restart(dtf: Dtf, address: str) -> float:
    host, port = address.rsplit(":", 1)
    os.kill(dtf.row("worker:1")["server_pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while port_open(host, int(port), 0.2):  # the kernel closes it at once; be sure we saw it closed
        if time.monotonic() - t0 > 5:
            raise SystemExit("the port stayed open after SIGKILL")
    while not port_open(host, int(port), 0.2):
        if time.monotonic() - t0 > 60:
            raise SystemExit("worker:1 not serving 60s after SIGKILL")
        time.sleep(0.01)
    return time.monotonic() - t0


def train(dtf: Dtf, out: Path, kill_ps_after_epoch: int | None) -> float:
    t0 = time.monotonic()
    run = Train(dtf.home, out.with_suffix(".log"), "--output", str(out),
                str(REPO / "examples" / "custom_loop.py"), "--epochs", "6", "--steps-per-epoch", "40")
    if kill_ps_after_epoch:
        run.wait_for(rf"^epoch {kill_ps_after_epoch}/6 done", timeout=300)
        os.kill(dtf.row("ps:0")["server_pid"], signal.SIGKILL)
    code, text = run.finish(timeout=600)
    if code != 0 or json.loads((out / "summary.json").read_text())["steps"] != 240:
        raise SystemExit(f"training failed ({code}):\n{text[-3000:]}")
    return time.monotonic() - t0


def lease_lapse(dtf: Dtf, lab: Lab, inventory: Path) -> float:
    dtf("up", "--ttl", "5s", str(inventory))
    lease = json.loads(Path(lab.hosts[0].workdir, "lab", "lease.json").read_text())
    end = lease["renewed"] + lease["ttl"]  # the host's clock is this machine's
    while lab.processes(lab.hosts[0]) or Path(lab.hosts[0].workdir, "lab").exists():
        if time.time() - end > 60:
            raise SystemExit("host not cleared 60s after its lease lapsed")
        time.sleep(0.01)
    cleared = time.time() - end
    dtf("down")  # forget the record (the hosts are already clean)
    return cleared


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, Lab(3, root=Path(tmp) / "lab") as lab:
        tmp_path = Path(tmp)
        dtf = Dtf(tmp_path / "home")
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; python {sys.executable}")
        ps, w0, w1 = lab.ports(3)
        inventory = lab.inventory(tmp_path / "three.yaml", [
            {"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}, {"host": "h2", "workers": [w1]}])
        dtf("up", str(inventory))
        address = dtf.row("worker:1")["address"]
        restarts = []
        for _ in range(args.repeat):
            restarts.append(worker_restart(dtf, address))
            time.sleep(1)
        print(f"worker SIGKILL -> serving again (default backoff 0.5s): {fmt(restarts)}")

        clean, faulty = [], []
        for i in range(args.repeat):
            clean.append(train(dtf, tmp_path / f"clean{i}", None))
            faulty.append(train(dtf, tmp_path / f"faulty{i}", 2))
        print(f"custom_loop 6x40 steps, no fault:         {fmt(clean)}")
        print(f"custom_loop 6x40 steps, ps killed at ep 2: {fmt(faulty)}")
        cost = statistics.median(faulty) - statistics.median(clean)
        print(f"what the lost ps cost end to end:          median {cost:.2f}s")
        dtf("down")

        lapses = [lease_lapse(dtf, lab, inventory) for _ in range(args.repeat)]
        print(f"lease lapsed -> host cleared (ttl 5s):    {fmt(lapses)}")


if __name__ == "__main__":
    main()
