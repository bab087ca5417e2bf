"""Managed environments on the Slurm lab: prints what happened and how long it took; asserts nothing.

    sudo .venv/bin/python bench/slurm_env.py [--cache DIR]

The nodes' python is Debian's /usr/bin/python3 (no TensorFlow, no pip), so `up` builds a managed
environment on each node from the laptop's wheels, through job steps only (the laptop reaches the
login host alone). Printed, in order:
- a cold `dtf up`: its time, each node's environment line (built, or copied from the other node),
  the bytes the laptop's ssh sent;
- the servers' command lines on the nodes (each must run the environment's python);
- `dtf train` of the custom-loop example for one epoch on those servers: its time and steps;
- `down`, then a second `up`: the environments found complete (reused), its time;
- `down --purge`: what each node removed, and what is left under the nodes' workdirs.
The test suite does not run this: each node's build is a 1.5 GB install (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from common import REPO  # (puts tests/ on the path)
from helpers import dtf, server_process
from slurmlab import SlurmLab

BARE_PYTHON = "/usr/bin/python3"


def sent_by_ssh() -> int:
    """Bytes written so far by this machine's running ssh processes (/proc/PID/io), for a difference:
    dtf's master to the login host carries every command and its data."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "ssh":
                continue
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            total += int(io["wchar"])
        except (OSError, ValueError, KeyError):
            continue
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", help="the laptop's wheel cache (DTF_CACHE); default: dtf's own")
    args = ap.parse_args()
    env = {"DTF_CACHE": args.cache} if args.cache else {}
    with tempfile.TemporaryDirectory() as tmp, SlurmLab(root=Path(tmp) / "lab", pick=True) as lab:
        home, workdir = Path(tmp) / "home", f"/srv/dtf-{lab.name}"
        inv = Path(tmp) / "inv.yaml"
        inv.write_text(yaml.safe_dump({
            "cluster": "slenv", "ssh_config": str(lab.ssh_config),
            "defaults": {"identity_file": str(lab.key), "python": "managed", "base_python": BARE_PYTHON,
                         "workdir": workdir},
            "slurm": {"login": lab.login.name, "nodes": 2, "ps": 1, "workers": 1}}, sort_keys=False))
        print(f"slurm lab {lab.name}: 2 nodes, base python {BARE_PYTHON}, workdir {workdir} (each node's own disk)")

        def run(*argv: str, timeout: float = 1200) -> tuple[subprocess.CompletedProcess[str], float]:
            t0 = time.monotonic()
            r = dtf(*argv, home=home, env=env, timeout=timeout)
            return r, time.monotonic() - t0

        before = sent_by_ssh()
        r, seconds = run("up", str(inv))
        print(f"cold up: exit {r.returncode} in {seconds:.1f} s")
        for line in r.stdout.splitlines():
            if "managed environment" in line or "copying" in line:
                print("  " + line)
        if r.returncode != 0:
            print(r.stdout[-3000:] + r.stderr[-3000:])
            return
        sent = (sent_by_ssh() - before) / 1e6
        print(f"  written by the laptop's ssh processes still running (the login host's master): {sent:.0f} MB")
        for pid, cmd in lab.processes(workdir):
            if server_process(pid, cmd, "serve"):
                print(f"  serving: {cmd[:160]}")

        out = Path(tmp) / "loop"
        r, seconds = run("train", "--output", str(out), str(REPO / "examples" / "custom_loop.py"), "--epochs", "1")
        steps = json.loads((out / "summary.json").read_text())["steps"] if (out / "summary.json").exists() else None
        print(f"train (custom_loop, 1 epoch): exit {r.returncode} in {seconds:.1f} s, {steps} steps")
        if r.returncode != 0:
            print(r.stderr[-3000:])

        r, seconds = run("down")
        print(f"down: exit {r.returncode} in {seconds:.1f} s")
        r, seconds = run("up", str(inv))
        print(f"warm up: exit {r.returncode} in {seconds:.1f} s")
        for line in r.stdout.splitlines():
            if "managed environment" in line:
                print("  " + line)
        r, seconds = run("down", "--purge")
        print(f"down --purge: exit {r.returncode} in {seconds:.1f} s")
        for line in r.stdout.splitlines():
            if "cache removed" in line:
                print("  " + line)
        left = lab.processes(workdir)
        files = {}  # as a job step sees the node's disk (slurmd's mount namespace): a job of our own
        for h in lab.computes:
            r = lab.slurm(["srun", "--quiet", "-N1", "-n1", f"-w{h.name}", "sh", "-c",
                           f"find {workdir} -mindepth 1 2>/dev/null | head -20"], timeout=60)
            files[h.name] = r.stdout.split()
        print(f"left on the nodes: {len(left)} process(es), files {files}; queue {lab.queue()}")


if __name__ == "__main__":
    sys.exit(main())
