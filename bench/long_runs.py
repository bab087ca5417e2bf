"""A laptop far from its cluster: steps/s of a stock tf-keras fit with the coordinator beside the
cluster, on a laptop 100 ms away (attached: `dtf train`), and detached (`dtf train --detach`, then
`dtf attach`), at 200-step and 2000-step epochs, on the SSH lab (1 ps, 2 workers on 3 hosts).

    sudo .venv/bin/python bench/long_runs.py [--delay-ms 50] [--steps 200,2000] [--epochs 6,3] [--repeats 2]

Modes:
- beside: `dtf train` on a cluster brought up as `dtf up` does by default (`network: auto`: the
  lab's hosts answer on their TF ports, so direct). The lab's hosts are network namespaces on this
  machine: the coordinator is beside them.
- attached: `dtf train` on a second cluster of the same hosts (other ports), `network: ssh`,
  every SSH connection to a host through bench/delay_relay.py (its ProxyCommand), which holds
  each chunk DELAY ms each way (these kernels have no netem): the laptop's side of a WAN.
- detached: `dtf train --detach` on that delayed cluster (it returns once the program has
  started on the cluster), then `dtf attach`, which prints the program's output and exits with
  its code. Skipped, with a line saying so, where `dtf train --help` offers no `--detach`.

The program (a 2-layer MLP on generated data, `model.fit` as tf-keras has it, `accuracy` metric,
no steps_per_execution: dtf packs) times itself: steady steps/s is between the end of its first
epoch and the end of its last (start-up, shipping and dtf's measurement of the round trip, all in
or before epoch 1, excluded); "start" is the wall time from the command to the program's first
line (connecting, shipping, TensorFlow's import); "after the last" is the time from the last
epoch's end to fit's return (TensorFlow freeing fit's datasets on the workers). The runs are
interleaved (every mode at one epoch length, then the next; all of it --repeats times) so that a
slow minute of a shared machine falls on every mode alike; each cell is the median of its runs.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import ps_and_two_workers  # (puts tests/ on the path)
from helpers import Train, dtf, stop_train
from lab import Lab

RELAY = Path(__file__).resolve().parent / "delay_relay.py"

PROGRAM = '''
import sys, time
print("bench: started", flush=True)
import dtf
import numpy as np
import tensorflow as tf

steps, epochs = int(sys.argv[1]), int(sys.argv[2])
strategy = dtf.strategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(32,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = (x[:, :10].argmax(1)).astype("int64")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)
ends = []

class Clock(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        ends.append(time.monotonic())

start = time.monotonic()
model.fit(data, epochs=epochs, steps_per_epoch=steps, callbacks=[Clock()])
end = time.monotonic()
done = int(model.optimizer.iterations.numpy())
print(f"bench: steady {(epochs - 1) * steps / (ends[-1] - ends[0]):.3f} steps/s, fit {end - start:.3f} s, "
      f"first epoch {ends[0] - start:.3f} s, after the last {end - ends[-1]:.3f} s, iterations {done}", flush=True)
'''

FIGURES = re.compile(r"^bench: steady ([\d.]+) steps/s, fit ([\d.]+) s, first epoch ([\d.]+) s, "
                     r"after the last ([\d.]+) s, iterations (\d+)", re.M)


@dataclass
class Result:
    steady: float  # steps/s between the ends of the first and the last epoch
    fit: float  # seconds of the whole fit, as the program timed it
    first: float  # seconds of the first epoch (dtf's measurement of the round trip included)
    last: float  # seconds from the end of the last epoch to fit's return
    start: float  # seconds from the command to the program's first line
    total: float  # seconds from the command to its end


def figures(text: str, steps: int, epochs: int, started: float, t0: float, t1: float) -> Result:
    found = FIGURES.search(text)
    if not found or int(found.group(5)) != steps * epochs:
        raise SystemExit(f"no figures from the program (or not {steps * epochs} iterations):\n{text[-3000:]}")
    return Result(float(found.group(1)), float(found.group(2)), float(found.group(3)), float(found.group(4)),
                  started - t0, t1 - t0)


def attached(home: Path, program: Path, out: Path, steps: int, epochs: int) -> Result:
    """One `dtf train` (beside and attached: the coordinator here)."""
    t0 = time.monotonic()
    run = Train(home, out, str(program), str(steps), str(epochs))
    started = run.wait_for(r"^bench: started", timeout=600)
    code, text = run.finish(timeout=1800)
    if code != 0:
        raise SystemExit(f"dtf train exited {code}:\n{text[-3000:]}")
    return figures(text, steps, epochs, started, t0, time.monotonic())


def detached(home: Path, program: Path, out: Path, steps: int, epochs: int) -> Result:
    """`dtf train --detach` (returns once the program started on the cluster), then `dtf attach`
    (follows it; its exit code is the program's)."""
    t0 = time.monotonic()
    r = dtf("train", "--detach", str(program), str(steps), str(epochs), home=home, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"dtf train --detach exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(out, "w") as f:
        f.write(r.stdout + r.stderr)
    with open(out, "a") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dtf", "attach"], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "DTF_HOME": str(home)})
    started = None
    deadline = time.monotonic() + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        if started is None and re.search(r"^bench: started", out.read_text(errors="replace"), re.M):
            started = time.monotonic()
        time.sleep(0.05)
    if proc.poll() is None:
        stop_train(proc)
        raise SystemExit(f"dtf attach still running after 1800 s:\n{out.read_text(errors='replace')[-3000:]}")
    text = out.read_text(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"dtf attach exited {proc.returncode}:\n{text[-3000:]}")
    end = time.monotonic()
    return figures(text, steps, epochs, started if started is not None else end, t0, end)


def can_detach() -> bool:
    r = subprocess.run([sys.executable, "-m", "dtf", "train", "--help"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "200"})
    return "--detach" in r.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=50.0, help="added each way (50: a 100 ms round trip)")
    parser.add_argument("--steps", default="200,2000", help="steps per epoch, one run per value")
    parser.add_argument("--epochs", default="6,3", help="epochs of each --steps value (at least 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell (the median is shown)")
    parser.add_argument("--modes", default="beside,attached,detached")
    args = parser.parse_args()
    lengths = [int(s) for s in args.steps.split(",")]
    epochs = [int(e) for e in args.epochs.split(",")]
    epochs += [epochs[-1]] * (len(lengths) - len(epochs))
    modes = args.modes.split(",")
    if "detached" in modes and not can_detach():
        print("detached: skipped (`dtf train --help` offers no --detach in this checkout)", flush=True)
        modes.remove("detached")
    rtt = f"+{2 * args.delay_ms:g} ms"
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        program = tmp / "program" / "fit.py"  # a folder of its own: a detached run ships the program's folder
        program.parent.mkdir()
        program.write_text(PROGRAM)
        wan = lab.root / "ssh_config_wan"
        wan.write_text(lab.ssh_config.read_text().replace(
            "  User root\n", f"  User root\n  ProxyCommand {sys.executable} {RELAY} %h %p {args.delay_ms:g}\n"))
        homes = {"near": tmp / "home-near", "far": tmp / "home-far"}
        ups: dict[str, float] = {}
        try:
            for i, (name, config, network) in enumerate([("near", lab.ssh_config, "auto"), ("far", wan, "ssh")]):
                if not set(modes) & ({"beside"} if name == "near" else {"attached", "detached"}):
                    continue
                inv = lab.inventory(tmp / f"inv-{name}.yaml", ps_and_two_workers(lab), cluster=f"long{i}")
                inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
                t0 = time.monotonic()
                dtf("up", str(inv), "--network", network, home=homes[name], timeout=600, check=True)
                ups[name] = time.monotonic() - t0
            results: dict[tuple[str, int], list[Result]] = {}
            for rep in range(args.repeats):
                for steps, n in zip(lengths, epochs):
                    for mode in modes:
                        out = tmp / f"{mode}-{steps}-{rep}.out"
                        if mode == "detached":
                            r = detached(homes["far"], program, out, steps, n)
                        else:
                            r = attached(homes["near" if mode == "beside" else "far"], program, out, steps, n)
                        results.setdefault((mode, steps), []).append(r)
                        print(f"  run {rep + 1}/{args.repeats}  {mode:<9} {steps:>5}-step epochs  "
                              f"{r.steady:7.1f} steps/s steady  fit {r.fit:6.1f} s (first epoch {r.first:5.1f} s, "
                              f"after the last {r.last:4.1f} s)  "
                              f"start {r.start:4.1f} s  total {r.total:6.1f} s", flush=True)
        finally:
            for name, home in homes.items():
                if name in ups:
                    dtf("down", home=home, timeout=300)
    print()
    print("  ".join(f"dtf up ({'no delay' if k == 'near' else rtt}) {v:.1f} s" for k, v in ups.items()))
    print(f"\nsteps/s (fit, 2-layer MLP, 1 ps + 2 workers; median of {args.repeats}; "
          f"attached and detached: {rtt} round trip)")
    print(f"{'mode':<10} {'epoch steps':>11} {'epochs':>6} {'steady steps/s':>15} {'ratio to beside':>16} "
          f"{'whole fit steps/s':>18} {'first epoch s':>14} {'after the last s':>17} {'start s':>8} "
          f"{'spread (steady)':>16}")
    for steps, n in zip(lengths, epochs):
        base = results.get(("beside", steps))
        base_steady = statistics.median(r.steady for r in base) if base else None
        for mode in modes:
            rs = results[mode, steps]
            steady = statistics.median(r.steady for r in rs)
            whole = statistics.median(steps * n / r.fit for r in rs)
            ratio = f"{steady / base_steady:.2f}x" if base_steady else "-"
            print(f"{mode:<10} {steps:>11} {n:>6} {steady:15.1f} {ratio:>16} {whole:18.1f} "
                  f"{statistics.median(r.first for r in rs):14.1f} {statistics.median(r.last for r in rs):17.1f} "
                  f"{statistics.median(r.start for r in rs):8.1f} "
                  f"{f'{min(r.steady for r in rs):.0f}-{max(r.steady for r in rs):.0f}':>16}")


if __name__ == "__main__":
    main()
