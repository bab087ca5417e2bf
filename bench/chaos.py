"""Chaos on the SSH lab: one training of a fixed number of steps with a schedule of faults; prints,
per fault, the time from the fault to training again, and the run's goodput against the same
training with no fault. Asserts nothing but that both trainings complete with every step.

    sudo .venv/bin/python bench/chaos.py [--epochs 30] [--steps 40] [--host-timeout 10]

The lab: 4 hosts, ps:0 on h0, worker:0 on h1, worker:1 on h2, h3 a spare. The schedule, each
fault once its epoch is done (a sixth, two fifths and two thirds of the epochs) and the fault
before it is over:
- supervisor: SIGKILL worker:1's supervisor (its server goes with it); training again when dtf
  has started it again (`... started again`): the other worker trained on meanwhile
- host lost: h2 (worker:1's host) cut off and its dtf processes killed, for good; training again
  when the program's next attempt has restored its checkpoint (`resumed at step`), on the spare
- ps killed: SIGKILL ps:0's server; training again when the next attempt has restored
Goodput: the steps asked (every one done once: the program resumes from its checkpoint) per
second of the faulty run's wall time, against the same with no fault.

A fault is a `Fault` (its name, the epoch after which it strikes, what it does, and the line
that says training is on again): a Slurm scenario adds its own (bench/chaos_slurm.py) and calls
`run_schedule` the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO
from helpers import Train, dtf, status_json, wait_gone
from lab import Lab


@dataclass
class Fault:
    name: str
    after_epoch: int  # strikes once this epoch is reported done (in whichever attempt)
    act: Callable[[], None]
    back: str  # a regex of the line that says training is on again after it


class Output:
    """The lines of a running `dtf train`, each with the time it was first seen."""

    def __init__(self, run: Train) -> None:
        self.run = run
        self.lines: list[tuple[float, str]] = []
        self.read = 0

    def poll(self) -> None:
        text = self.run.text()
        complete = text[:text.rfind("\n") + 1]
        now = time.monotonic()
        for line in complete[self.read:].splitlines():
            self.lines.append((now, line))
        self.read = len(complete)

    def epoch_done(self, epoch: int, since: float, back: str | None) -> bool:
        """Whether an epoch at or past `epoch` was reported after the line `back` (seen after
        `since`): a fault strikes in training, not while the program starts again."""
        after = since if back is None else self.first(back, since)
        if after is None:
            return False
        return any(int(m.group(1)) >= epoch for t, line in self.lines if t >= after
                   and (m := re.match(r"^epoch (\d+)/\d+ done", line)))

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if t >= after and re.search(pattern, line)), None)


def train_args(out: Path, epochs: int, steps: int) -> list[str]:
    return ["--attempts", "5", "--output", str(out), str(REPO / "examples" / "custom_loop.py"),
            "--epochs", str(epochs), "--steps-per-epoch", str(steps)]


def run_schedule(home: Path, args: list[str], log: Path, faults: list[Fault], total_steps: int,
                 timeout: float = 1800) -> tuple[float, dict[str, float]]:
    """Run `dtf train ARGS`, strike each fault after its epoch; the wall time and, per fault, the
    seconds from the fault to its `back` line. Exits (SystemExit) when the training fails."""
    out = Path(args[args.index("--output") + 1])
    t0 = time.monotonic()
    run = Train(home, log, *args)
    seen = Output(run)
    struck: dict[str, float] = {}
    pending = list(faults)
    deadline = t0 + timeout
    last: Fault | None = None
    while run.proc.poll() is None:
        seen.poll()
        # A fault strikes once its epoch is done and the one before is over (training again).
        if pending and seen.epoch_done(pending[0].after_epoch, struck[last.name] if last else 0.0,
                                       last.back if last else None):
            last = pending.pop(0)
            last.act()
            struck[last.name] = time.monotonic()
        if time.monotonic() > deadline:
            run.proc.kill()
            raise SystemExit(f"still training after {timeout:g}s:\n{run.text()[-3000:]}")
        time.sleep(0.05)
    wall = time.monotonic() - t0
    code, _ = run.finish()
    seen.poll()
    for _, line in seen.lines:
        if line.startswith("dtf:") or re.match(r"^(epoch \d+/\d+ done|resumed at step)", line):
            print(f"  | {line}")
    done = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if code != 0 or done.get("steps") != total_steps or pending:
        raise SystemExit(f"training failed (exit {code}, steps {done.get('steps')}, faults not struck: "
                         f"{[f.name for f in pending]})")
    back = {}
    for fault in faults:
        at = seen.first(fault.back, after=struck[fault.name])
        back[fault.name] = (at - struck[fault.name]) if at is not None else float("nan")
    return wall, back


def ssh_faults(lab: Lab, home: Path, epochs: int) -> list[Fault]:
    """The SSH lab's schedule (see the module)."""
    def row(task: str) -> dict[str, Any]:
        return next(r for r in status_json(home)["tasks"] if r["task"] == task)

    def kill_supervisor() -> None:
        pid = row("worker:1")["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid])

    def lose_host() -> None:
        lab.link_down("h2")
        pids = [pid for pid, _ in lab.processes("h2")]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(pids)

    def kill_ps() -> None:
        pid = row("ps:0")["server_pid"]
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid])

    return [Fault("supervisor killed (worker:1)", max(1, epochs // 6), kill_supervisor,
                  r"worker:1 on h2 started again"),
            Fault("host lost for good (h2)", max(2, 2 * epochs // 5), lose_host, r"^resumed at step"),
            Fault("ps killed (ps:0)", max(3, 2 * epochs // 3), kill_ps, r"^resumed at step")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--host-timeout", type=float, default=10.0)
    args = ap.parse_args()
    total = args.epochs * args.steps
    with tempfile.TemporaryDirectory() as tmp, Lab(4, root=Path(tmp) / "lab") as lab:
        if lab.mode != "netns":
            raise SystemExit("losing a host needs the lab in network namespaces")
        tmp_path = Path(tmp)
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; python {sys.executable}")
        ps, w0, w1 = lab.ports(3)
        inventory = lab.inventory(tmp_path / "chaos.yaml", [
            {"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}, {"host": "h2", "workers": [w1]}])
        text = inventory.read_text() + (f"host_timeout: {args.host_timeout:g}\n"
                                        f"spares:\n  - host: h3\n    workdir: {lab.host('h3').workdir}\n")
        inventory.write_text(text)

        home = tmp_path / "clean-home"
        dtf("up", str(inventory), home=home, timeout=600, check=True)
        clean, _ = run_schedule(home, train_args(tmp_path / "clean", args.epochs, args.steps),
                                tmp_path / "clean.log", [], total)
        dtf("down", home=home, timeout=600, check=True)

        home = tmp_path / "chaos-home"
        dtf("up", str(inventory), home=home, timeout=600, check=True)
        try:
            faulty, back = run_schedule(home, train_args(tmp_path / "chaos", args.epochs, args.steps),
                                        tmp_path / "chaos.log", ssh_faults(lab, home, args.epochs), total)
        finally:
            lab.link_up("h2")
            dtf("down", home=home, timeout=600)
        print(f"custom_loop {args.epochs}x{args.steps} steps, host_timeout {args.host_timeout:g}s")
        print(f"{'fault':32} {'fault -> training again':>24}")
        for name, seconds in back.items():
            print(f"{name:32} {seconds:23.1f}s")
        print(f"no fault:    {clean:7.1f}s  goodput {total / clean:6.1f} steps/s")
        print(f"with faults: {faulty:7.1f}s  goodput {total / faulty:6.1f} steps/s "
              f"({100 * clean / faulty:.0f}% of the run with no fault)")


if __name__ == "__main__":
    main()
