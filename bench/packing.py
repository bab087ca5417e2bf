"""Automatic step packing: steps/s of a tf-keras fit program that sets no steps_per_execution
(dtf packs), the same at 100 steps per closure, and at 1 (packing off: `dtf train --no-packing`),
on the SSH lab (1 ps, 2 workers, ssh network mode), with no added delay and through an emulated
WAN (+24 ms round trip: bench/delay_relay.py as the hosts' ProxyCommand; no netem here).

    sudo .venv/bin/python bench/packing.py [--delay-ms 12] [--steps 200]

Steady steps/s is measured between the end of epoch 1 and the end of epoch 3 (start-up and
dtf's measurement, which runs in epoch 1, excluded); "whole fit" is all 3 epochs, as the program
times them.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from common import ps_and_two_workers  # (puts tests/ on the path)
from helpers import Train, dtf
from lab import Lab

RELAY = Path(__file__).resolve().parent / "delay_relay.py"

PROGRAM = '''
import sys, time
import dtf
import numpy as np
import tensorflow as tf
setting, steps = sys.argv[1], int(sys.argv[2])
strategy = dtf.strategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(32,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    chosen = {} if setting == "none" else {"steps_per_execution": int(setting)}
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), **chosen)
rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = (x[:, :10].argmax(1)).astype("int64")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)

class Progress(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1} done", flush=True)

t0 = time.monotonic()
model.fit(data, epochs=3, steps_per_epoch=steps, verbose=0, callbacks=[Progress()])
print(f"fit {time.monotonic() - t0:.3f}s iterations {int(model.optimizer.iterations.numpy())}", flush=True)
'''

SETTINGS = [("no setting (dtf packs)", "none", []), ("100 per closure", "100", []),
            ("1 per closure (--no-packing)", "none", ["--no-packing"])]


def run(home: Path, tmp: Path, tag: str, setting: str, flags: list[str], steps: int) -> tuple[float, float, str]:
    """(steady steps/s, whole-fit steps/s, what dtf chose) of one `dtf train`."""
    program = tmp / "fit.py"
    program.write_text(PROGRAM)
    run = Train(home, tmp / f"{tag}.out", *flags, str(program), setting, str(steps))
    t1 = run.wait_for(r"^epoch 1 done", timeout=900)
    t3 = run.wait_for(r"^epoch 3 done", timeout=1800)
    code, text = run.finish(timeout=120)
    assert code == 0, text[-3000:]
    fit = re.search(r"^fit ([\d.]+)s iterations (\d+)", text, re.M)
    assert fit and int(fit.group(2)) == 3 * steps, text[-3000:]
    chosen = re.search(r"^dtf: packing .*$", text, re.M)
    return 2 * steps / (t3 - t1), 3 * steps / float(fit.group(1)), chosen.group(0)[5:] if chosen else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=12.0, help="added each way (12: a 24 ms round trip)")
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d, Lab(3, root=Path(d) / "lab", mode="netns") as lab:
        tmp = Path(d)
        hosts = ps_and_two_workers(lab)
        wan = lab.root / "ssh_config_wan"
        wan.write_text(lab.ssh_config.read_text().replace(
            "  User root\n", f"  User root\n  ProxyCommand {sys.executable} {RELAY} %h %p {args.delay_ms:g}\n"))
        rows: list[tuple[str, str, float, float, str]] = []
        for n, (label, config) in enumerate([("ssh, +0 ms", lab.ssh_config),
                                             (f"ssh, +{2 * args.delay_ms:g} ms RTT", wan)]):
            home = tmp / f"home-{n}"
            inv = lab.inventory(tmp / f"inv-{n}.yaml", hosts)
            inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(config)))
            dtf("up", str(inv), "--network", "ssh", home=home, timeout=300, check=True)
            try:
                for m, (name, setting, flags) in enumerate(SETTINGS):
                    steady, whole, chosen = run(home, tmp, f"{n}-{m}", setting, flags, args.steps)
                    rows.append((label, name, steady, whole, chosen))
                    print(f"{label:<18} {name:<30} {steady:8.1f} steps/s steady {whole:8.1f} whole fit  {chosen}",
                          flush=True)
            finally:
                dtf("down", home=home, timeout=300)
        print(f"\nsteps/s (fit, 2-layer MLP, 1 ps + 2 workers, ssh mode, {args.steps} steps per epoch, 3 epochs)")
        print(f"{'network':<18} {'steps per closure':<30} {'steady':>8} {'whole':>8}  what dtf chose")
        for label, name, steady, whole, chosen in rows:
            print(f"{label:<18} {name:<30} {steady:8.1f} {whole:8.1f}  {chosen}")
        for label in dict.fromkeys(r[0] for r in rows):
            by = {r[1]: r for r in rows if r[0] == label}
            auto, hundred = by[SETTINGS[0][0]], by[SETTINGS[1][0]]
            print(f"{label}: no setting / 100 per closure = {auto[2] / hundred[2]:.2f}x steady, "
                  f"{auto[3] / hundred[3]:.2f}x whole fit")


if __name__ == "__main__":
    main()
