"""`dtf top` and training speed: steps/s of a tf-keras fit on the SSH lab (1 ps, 2 workers,
fake-free: real TensorFlow) with dtf's figures not published (DTF_FIGURES=off), published (the
default), and published with `dtf top` attached (its live view in a tmux pane, refreshing every
second, its hosts sampling every second), in interleaved rounds.

    sudo .venv/bin/python bench/top.py [--rounds 3] [--steps 1000]

Steady steps/s is measured between the end of epoch 1 and the end of epoch 4 (start-up excluded);
nothing else is started in that window (`dtf top` is started before the program, and its screen
is captured with tmux, which costs nothing measurable).
Everything (the hosts' TensorFlow, the program, `dtf top`) shares this machine's cores: an upper
bound of what the view costs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from common import REPO, ps_and_two_workers
from helpers import Train, dtf
from lab import Lab

PROGRAM = '''
import time
import dtf
import numpy as np
import tensorflow as tf
import sys
steps = int(sys.argv[1])
strategy = dtf.strategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(32,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=10)
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = (x[:, :10].argmax(1)).astype("int64")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)

class Progress(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1} done", flush=True)

model.fit(data, epochs=4, steps_per_epoch=steps, verbose=0, callbacks=[Progress()])
'''

CONFIGS = [("figures off", {"DTF_FIGURES": "off"}, False), ("figures on", {}, False),
           ("figures on + dtf top attached", {}, True)]


def one(home: Path, tmp: Path, tag: str, env: dict[str, str], attached: bool, steps: int) -> tuple[float, str]:
    """(steady steps/s, what `dtf top` showed mid-run)."""
    import os

    program = tmp / "fit.py"
    program.write_text(PROGRAM)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run = Train(home, tmp / f"{tag}.out", str(program), str(steps))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    socket = f"dtfbench-{uuid.uuid4().hex[:8]}"
    shown = ""
    try:
        if attached:
            subprocess.run(["tmux", "-L", socket, "new-session", "-d", "-x", "160", "-y", "30",
                            f"cd {REPO} && env -u COLUMNS -u LINES DTF_HOME={home} {sys.executable} -m dtf.cli top"],
                           check=True, timeout=15)
        t1 = run.wait_for(r"^epoch 1 done", timeout=900)
        run.wait_for(r"^epoch 2 done", timeout=900)
        if attached:  # a screen capture costs nothing here; no other process runs in the window
            shown = subprocess.run(["tmux", "-L", socket, "capture-pane", "-p"], capture_output=True, text=True,
                                   timeout=15).stdout
        t4 = run.wait_for(r"^epoch 4 done", timeout=1800)
        code, text = run.finish(timeout=120)
        assert code == 0, text[-3000:]
    finally:
        if attached:
            subprocess.run(["tmux", "-L", socket, "kill-server"], timeout=15)
    return 3 * steps / (t4 - t1), shown


def per_closure_ns(n: int = 200_000) -> float:
    """The figures' whole cost on the training's threads: one closure_done (a lock and a few additions)."""
    import time

    from dtf.program.figures import Figures

    f = Figures(Path("/nonexistent/train.json"))
    t0 = time.perf_counter()
    for i in range(n):
        f.closure_done(i & 1, 10)
    return (time.perf_counter() - t0) / n * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help="steps per epoch")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("bench/top.py needs tmux (apt-get install tmux)")
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp, home = Path(d), Path(d) / "home"
        hosts = ps_and_two_workers(lab)
        inv = lab.inventory(tmp / "inv.yaml", hosts)
        dtf("up", str(inv), home=home, timeout=300, check=True)
        results: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
        printed = False
        try:
            for r in range(args.rounds):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]  # each goes first in turn
                for n, (name, env, attached) in enumerate(order):
                    rate, shown = one(home, tmp, f"{r}-{n}", env, attached, args.steps)
                    results[name].append(rate)
                    print(f"round {r + 1} {name:<32} {rate:8.1f} steps/s steady", flush=True)
                    if shown and not printed:
                        printed = True
                        print(f"  dtf top showed mid-run:\n{shown.rstrip()}\n", flush=True)
        finally:
            dtf("down", home=home, timeout=300)
        print(f"\nwhat the training's threads pay per closure (Figures.closure_done): {per_closure_ns():.0f} ns")
        print(f"\nsteps/s (fit, 2-layer MLP, 1 ps + 2 workers on the SSH lab, 10 steps per closure, "
              f"{args.steps} steps per epoch, steady over epochs 2-4), {args.rounds} rounds interleaved, "
              f"each configuration first in turn")
        base = statistics.median(results[CONFIGS[0][0]])
        for name, rates in results.items():
            med = statistics.median(rates)
            print(f"{name:<32} median {med:8.1f}  (min {min(rates):.1f}, max {max(rates):.1f})  "
                  f"{med / base:.3f}x of figures off")


if __name__ == "__main__":
    main()
