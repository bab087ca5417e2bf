"""Automatic step packing on the SSH lab, through an emulated WAN: every SSH connection (and so,
in ssh network mode, every connection of the coordinator to a task) goes through
bench/delay_relay.py, which holds each chunk 12 ms each way (these kernels have no netem)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, dtf

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.slow]

RELAY = REPO / "bench" / "delay_relay.py"

FIT = textwrap.dedent("""
    import sys
    import dtf
    import numpy as np
    import tensorflow as tf
    strategy = dtf.strategy()
    x = np.random.default_rng(0).random((256, 8)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).repeat().batch(16)
    for setting in sys.argv[1:]:  # "none", "auto", or a number: the program's steps_per_execution
        print("fit with", setting, file=sys.stderr, flush=True)  # dtf's packing line follows, on stderr
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Input(shape=(8,)), tf.keras.layers.Dense(1)])
            chosen = {} if setting == "none" else {"steps_per_execution": setting if setting == "auto" else int(setting)}
            model.compile(optimizer="sgd", loss="mse", **chosen)
        # 100 steps an epoch where dtf measures and packs; 20 where the program's own value holds
        # (had dtf measured, it would say so: "packing: fit ended while dtf was still measuring").
        model.fit(data, epochs=2, steps_per_epoch=100 if setting in ("none", "auto") else 20, verbose=0)
        print(setting, "iterations", int(model.optimizer.iterations.numpy()), "after", int(model.steps_per_execution.numpy()))
""")


def test_a_long_round_trip_packs_steps_and_an_explicit_value_wins(lab, write_inventory, home, tmp_path: Path):
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    wan = tmp_path / "ssh_config_wan"
    wan.write_text(lab.ssh_config.read_text().replace(
        "  User root\n", f"  User root\n  ProxyCommand {sys.executable} {RELAY} %h %p 12\n"))
    inv.write_text(inv.read_text().replace(str(lab.ssh_config), str(wan)))
    r = dtf("up", str(inv), "--network", "ssh", home=home, timeout=300)
    assert r.returncode == 0, r.stderr
    program = tmp_path / "fit.py"
    program.write_text(FIT)

    def train(*settings: str) -> dict[str, tuple[str, str]]:
        """Each setting's fit in one program (one TensorFlow start): {setting: (its stdout line, its stderr)}."""
        run = dtf("train", str(program), *settings, home=home, timeout=400)
        assert run.returncode == 0, run.stderr[-4000:]
        errs = dict(part.split("\n", 1) for part in run.stderr.split("fit with ")[1:])
        outs = {line.split()[0]: line for line in run.stdout.splitlines() if " iterations " in line}
        assert set(errs) == set(outs) == set(settings), (run.stdout[-3000:], run.stderr[-3000:])
        for setting in settings:  # every step, and no more
            assert f" iterations {200 if setting in ('none', 'auto') else 40} after " in outs[setting], run.stdout
        return {setting: (outs[setting], errs[setting]) for setting in settings}

    fits = train("none", "auto", "1", "5")
    for setting in ("none", "auto"):
        out, err = fits[setting]
        chosen = re.search(r"^dtf: packing (\d+) steps? per closure \(round trip ([\d.]+) ms", err, re.M)
        assert chosen, err[-3000:]
        print(f"{setting}: {chosen.group(0)}")
        assert int(chosen.group(1)) > 1 and float(chosen.group(2)) >= 20  # 24 ms added per round trip
        assert out.endswith(" after 1")  # the program's own value is back after fit
    for setting in ("1", "5"):
        out, err = fits[setting]
        assert "dtf: packing" not in err
        assert out.endswith(f" after {setting}")
