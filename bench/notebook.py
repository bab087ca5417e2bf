"""Training from a notebook: what a kernel pays. `dtf.connect()`'s time in a fresh Jupyter kernel
(TensorFlow already imported), and steps/s of the same tf-keras fit from a kernel and from
`dtf train`, on the SSH lab (3 hosts: 1 ps, 2 workers), in direct and ssh network modes.

    sudo .venv/bin/python bench/notebook.py [--runs 3] [--steps 200]

The fit: a 2-layer MLP, steps_per_execution 10, 3 epochs of STEPS steps; steady steps/s between
the end of epoch 1 and the end of epoch 3, timed inside the process (the kernel, or the program of
`dtf train`), so start-up is left out of both. The kernel and `dtf train` runs alternate.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from common import REPO, ps_and_two_workers
from helpers import dtf
from lab import Lab

sys.path.insert(0, str(REPO / "tests" / "e2e"))
from test_notebook import Kernel  # the tests' real kernel: ipykernel's python3

TRAIN = '''
import time
import dtf
import numpy as np
import tensorflow as tf
STEPS = {steps}
cluster = dtf.connect()
with cluster.strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(32,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=10)
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = (x[:, :10].argmax(1)).astype("int64")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)
stamps = []

class Times(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        stamps.append(time.monotonic())

model.fit(data, epochs=3, steps_per_epoch=STEPS, verbose=0, callbacks=[Times()])
print(f"steady {{2 * STEPS / (stamps[2] - stamps[0]):.2f}} steps/s")
'''

CONNECT = "import time\nt0 = time.monotonic()\ncluster = dtf.connect()\nprint(f'connect {time.monotonic() - t0:.3f}s')"


def steady(text: str) -> float:
    found = re.search(r"^steady ([\d.]+) steps/s", text, re.M)
    assert found, text[-3000:]
    return float(found.group(1))


def in_kernel(home: Path, cwd: Path, code: str) -> str:
    k = Kernel(home, cwd)
    try:
        k.ok("import dtf\nimport tensorflow as tf")
        return k.ok(code, timeout=1800)
    finally:
        k.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        hosts = ps_and_two_workers(lab)
        program = tmp / "train.py"
        program.write_text(TRAIN.format(steps=args.steps))
        rows = []
        for mode in ("direct", "ssh"):
            home = tmp / f"home-{mode}"
            inv = lab.inventory(tmp / f"inv-{mode}.yaml", hosts, cluster="bench")
            dtf("up", str(inv), "--network", mode, home=home, timeout=300, check=True)
            try:
                connects, kernel, train = [], [], []
                for n in range(args.runs):
                    out = in_kernel(home, tmp, CONNECT)
                    connects.append(float(re.search(r"^connect ([\d.]+)s", out, re.M).group(1)))  # type: ignore[union-attr]
                    kernel.append(steady(in_kernel(home, tmp, TRAIN.format(steps=args.steps))))
                    r = dtf("train", str(program), home=home, cwd=tmp, timeout=1800, check=True)
                    train.append(steady(r.stdout))
                    print(f"{mode} run {n + 1}: connect {connects[-1]:.2f}s, kernel {kernel[-1]:.1f} steps/s, "
                          f"dtf train {train[-1]:.1f} steps/s", flush=True)
                rows.append((mode, connects, kernel, train))
            finally:
                dtf("down", home=home, timeout=300)
        print(f"\n3 hosts (1 ps, 2 workers); fit of a 2-layer MLP, steps_per_execution 10, {args.steps} steps per "
              f"epoch; medians of {args.runs} runs (min-max)")
        print(f"{'network':<8} {'dtf.connect()':>22} {'kernel steps/s':>22} {'dtf train steps/s':>22} {'ratio':>6}")
        for mode, connects, kernel, train in rows:
            def cell(xs: list[float], unit: str = "") -> str:
                return f"{statistics.median(xs):.2f}{unit} ({min(xs):.2f}-{max(xs):.2f})"
            ratio = statistics.median(kernel) / statistics.median(train)
            print(f"{mode:<8} {cell(connects, 's'):>22} {cell(kernel):>22} {cell(train):>22} {ratio:6.2f}")


if __name__ == "__main__":
    main()
