"""A node lost mid-run on the Slurm lab: what it costs `dtf train`. Prints, asserts nothing.

    sudo .venv/bin/python bench/chaos_slurm.py [--epochs 4] [--steps-per-epoch 20] [--repeat 1]

One fixed-steps training (examples/mnist_fit.py, real TensorFlow) on a one-node allocation (1 ps,
1 worker): once with no fault, once with the node crashed after the first epoch (its slurmd and
every process of the job's there SIGKILLed: tests/slurm/test_comeback.crash). Slurm ends the job
(NODE_FAIL) once the node has not answered; `dtf train --attempts 2` asks for a new allocation,
which Slurm grants on the lab's other node, starts the tasks there, and the program's second
attempt resumes from its last checkpoint. Each run starts from a fresh `dtf up`.

Per fault it prints the time from the crash to:
- detected: `dtf train` says the job has ended (or lost its node) and asks for a new allocation;
- serving: the new allocation's tasks serve;
- training again: the second attempt's first step done (the program's figures, which `dtf top`
  reads, published once a second: to within that second);
what the fault cost the run (the difference of the wall times), and the run's goodput: the
no-fault run's wall time over the faulty run's (the same steps done; the final step count is
checked, so no step counted twice). The cost is mostly fixed (Slurm's time to find the node, the
start, the restore): the longer the run, the nearer its goodput to 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, as_installed, fmt
from helpers import Train, dtf, status_json
from slurmlab import SlurmLab

sys.path.insert(0, str(REPO / "tests" / "slurm"))
from test_comeback import crash  # the tests' own crash of a node
from test_up_down import inventory  # the tests' own inventory of the Slurm lab

CLUSTER = "chaos"


def training_again(home: Path, attempt: int) -> bool:
    """The program's figures say that attempt `attempt` has done a step."""
    try:
        doc = json.loads((home / "live" / CLUSTER / "train.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(doc.get("attempt") == attempt and (doc.get("steps") or 0) > 0)


def one_run(lab: SlurmLab, tmp: Path, name: str, epochs: int, steps: int, fault: bool) -> dict[str, float]:
    home, out = tmp / f"home-{name}", tmp / f"out-{name}"
    inv = inventory(lab, tmp / f"{name}.yaml", cluster=CLUSTER, nodes=1)
    dtf("up", str(inv), home=home, timeout=600, check=True)
    node = status_json(home)["slurm"]["nodes"][0]
    t0 = time.monotonic()
    run = Train(home, tmp / f"{name}.log", "--attempts", "2", "--output", str(out),
                str(REPO / "examples" / "mnist_fit.py"), "--epochs", str(epochs), "--steps-per-epoch", str(steps),
                "--steps-per-execution", "5", "--no-export", cwd=tmp)
    marks: dict[str, float] = {}
    try:
        if fault:
            run.wait_for(rf"^epoch 1/{epochs} done", timeout=600)
            crash(lab, node)
            marks["fault"] = time.monotonic()
            wanted = {"detected": r"asking Slurm for a new allocation", "serving": r"^dtf: job \d+ replaces job"}
            while "training" not in marks and run.proc.poll() is None:
                now, text = time.monotonic(), run.text()
                for mark, pattern in wanted.items():
                    if mark not in marks and re.search(pattern, text, re.M):
                        marks[mark] = now
                if "serving" in marks and training_again(home, 2):
                    marks["training"] = now
                time.sleep(0.05)
        code, text = run.finish(timeout=1200)
    finally:
        dtf("down", home=home, timeout=300)
        if fault:
            lab.restart_slurmd(node)
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if code != 0 or summary.get("steps") != epochs * steps:
        raise SystemExit(f"{name}: training failed ({code}, summary {summary}):\n{text[-4000:]}")
    result = {"wall": wall}
    for mark in ("detected", "serving", "training"):
        if mark in marks:
            result[mark] = marks[mark] - marks["fault"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    name, subnet = os.environ.get("DTF_SLURM_LAB_NAME"), os.environ.get("DTF_SLURM_LAB_SUBNET")
    with tempfile.TemporaryDirectory() as tmp, SlurmLab(root=Path(tmp) / "lab", name=name, subnet=subnet,
                                                      pick=not (name and subnet)) as lab:
        clean: list[dict[str, float]] = []
        faulty: list[dict[str, float]] = []
        for i in range(args.repeat):
            clean.append(one_run(lab, Path(tmp), f"clean{i}", args.epochs, args.steps_per_epoch, fault=False))
            faulty.append(one_run(lab, Path(tmp), f"fault{i}", args.epochs, args.steps_per_epoch, fault=True))
        total = args.epochs * args.steps_per_epoch
        print(f"slurm lab: 1 node x (1 ps, 1 worker), mnist_fit {args.epochs} epochs x {args.steps_per_epoch} "
              f"steps ({total}); the node crashed after epoch 1; SlurmdTimeout 30s; load {os.getloadavg()[0]:.1f}")
        print(f"{'fault':<34}{'detected':>10}{'serving':>10}{'training again':>16}")
        for run in faulty:
            print(f"{'node crashed (slurmd + job killed)':<34}{run['detected']:>9.1f}s{run['serving']:>9.1f}s"
                  f"{run['training']:>15.1f}s")
        print(f"no fault:   {fmt([r['wall'] for r in clean])}")
        print(f"node lost:  {fmt([r['wall'] for r in faulty])}")
        cost = statistics.median(r["wall"] for r in faulty) - statistics.median(r["wall"] for r in clean)
        print(f"what the lost node cost the run (difference of the medians): {cost:.1f}s")
        goodput = statistics.median(r["wall"] for r in clean) / statistics.median(r["wall"] for r in faulty)
        print(f"goodput (no-fault wall / faulty wall, the same {total} steps): {goodput:.2f}")


if __name__ == "__main__":
    as_installed()
    main()
