"""`dtf train --collective` against the same program started by hand, on the SSH lab (3 hosts, one
worker each; examples/simple_worker_mnist.py): steps/s, the time from the command to the first
step, and the time a lost worker costs a run end to end.

    sudo .venv/bin/python bench/collective.py [--steps 60] [--repeats 2]

By hand means: `ssh HOST env TF_CONFIG=... python simple_worker_mnist.py` on every host at once,
the TF_CONFIG that dtf gives the copies (the same hosts; other ports, since the cluster's own are
the dtf runs'), the program on a path every host sees. Steps/s is measured on the chief's
output as it arrives here, between the ends of epochs 1 and 3 (start-up excluded); the runs of the
two kinds alternate, so a slow minute of a shared machine falls on both. The lost worker: worker:1's
program is killed with SIGKILL at the end of epoch 2 of 5 (--attempts 2): the whole run's wall time
against the same run undisturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO
from helpers import dtf
from lab import Lab

PROGRAM = REPO / "examples" / "simple_worker_mnist.py"


class Timed:
    """A command whose output lines are timestamped as they arrive here."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
        self.lines: list[tuple[float, str]] = []

    def until(self, pattern: str, timeout: float = 900) -> float:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            if re.search(pattern, line):
                return time.monotonic()
        raise SystemExit(f"no {pattern!r}:\n{''.join(x for _, x in self.lines[-40:])}")

    def finish(self) -> float:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
        code = self.proc.wait(timeout=300)
        if code != 0:
            raise SystemExit(f"exit {code}:\n{''.join(x for _, x in self.lines[-40:])}")
        return time.monotonic() - self.t0


def measure(run: Timed, steps: int) -> tuple[float, float]:
    """(seconds from the command to the first step, steps/s between the ends of epochs 1 and 3)."""
    first = run.until(r"first step done") - run.t0
    t1 = run.until(r"epoch 0 done")
    t3 = run.until(r"epoch 2 done")
    run.finish()
    return first, 2 * steps / (t3 - t1)


def by_hand(lab: Lab, ports: list[int], program: Path, steps: int, tmp: Path) -> Timed:
    """Every host runs the program itself, over ssh; the chief's output is the Timed one."""
    cluster = {"worker": [f"{h.address}:{p}" for h, p in zip(lab.hosts, ports)]}
    procs = []
    for i, h in enumerate(lab.hosts):
        cwd = tmp / f"hand-{i}-{time.monotonic_ns()}"
        cwd.mkdir()
        config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        remote = (f"cd {cwd} && env TF_CONFIG='{config}' TF_USE_LEGACY_KERAS=1 PYTHONUNBUFFERED=1 "
                  f"{sys.executable} {program} --epochs 3 --steps {steps}")
        argv = ["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), h.name, remote]
        procs.append(Timed(argv))
    chief = procs[0]
    chief.others = procs[1:]  # type: ignore[attr-defined]
    return chief


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {"dtf --collective": [], "by hand": []}
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        program = tmp / "prog" / PROGRAM.name  # a path every host sees (for the runs by hand)
        program.parent.mkdir()
        shutil.copy(PROGRAM, program)
        home = tmp / "home"
        ports = lab.ports(6)
        inv = lab.inventory(tmp / "inv.yaml", [{"host": h.name, "workers": [p]} for h, p in zip(lab.hosts, ports)],
                            cluster="bench")
        dtf("up", str(inv), home=home, timeout=300, check=True)
        env = {"DTF_HOME": str(home)}
        try:
            for _ in range(args.repeats):
                hand = by_hand(lab, ports[3:], program, args.steps, tmp)
                figures["by hand"].append(measure(hand, args.steps))
                for other in hand.others:  # type: ignore[attr-defined]
                    other.finish()
                run = Timed([sys.executable, "-m", "dtf.cli", "train", "--collective", "--output",
                             str(tmp / f"out-{time.monotonic_ns()}"), str(program), "--epochs", "3",
                             "--steps", str(args.steps)], env)
                figures["dtf --collective"].append(measure(run, args.steps))
            # A lost worker: the same 5-epoch run, undisturbed and with worker:1 killed after epoch 2.
            base = [sys.executable, "-m", "dtf.cli", "train", "--collective", "--attempts", "2"]
            rest = [str(program), "--epochs", "5", "--steps", str(args.steps)]
            clean = Timed([*base, "--output", str(tmp / "clean"), *rest], env).finish()
            killed = Timed([*base, "--output", str(tmp / "killed"), *rest], env)
            killed.until(r"\[worker:0 \S+\] epoch 1 done")
            for pid, cmd in lab.processes(lab.hosts[1]):
                if "dtf.program.runner" in cmd and "supervise-program" not in cmd:
                    os.kill(pid, 9)
            lost = killed.finish()
        finally:
            dtf("down", home=home, timeout=300)
    print(f"\nsteps/s and time to the first step, {args.steps} steps per epoch, 3 hosts x 1 worker, "
          f"median of {args.repeats}:")
    for name, rows in figures.items():
        first = statistics.median(r[0] for r in rows)
        rate = statistics.median(r[1] for r in rows)
        print(f"  {name:18s} {rate:7.1f} steps/s   first step {first:5.1f}s after the command   "
              f"(runs: {', '.join(f'{r[1]:.1f}' for r in rows)})")
    ratio = statistics.median(r[1] for r in figures["dtf --collective"]) / statistics.median(
        r[1] for r in figures["by hand"])
    print(f"  dtf / by hand: {ratio:.3f}")
    print(f"a lost worker (killed after epoch 2 of 5, --attempts 2): {lost:.1f}s end to end, "
          f"{clean:.1f}s undisturbed: it cost {lost - clean:.1f}s")


if __name__ == "__main__":
    main()
