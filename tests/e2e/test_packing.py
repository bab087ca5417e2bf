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
    setting = sys.argv[1]  # "none", "auto", or a number: the program's steps_per_execution
    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(8,)), tf.keras.layers.Dense(1)])
        chosen = {} if setting == "none" else {"steps_per_execution": setting if setting == "auto" else int(setting)}
        model.compile(optimizer="sgd", loss="mse", **chosen)
    x = np.random.default_rng(0).random((256, 8)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).repeat().batch(16)
    model.fit(data, epochs=2, steps_per_epoch=100, verbose=0)
    print("iterations", int(model.optimizer.iterations.numpy()), "after", int(model.steps_per_execution.numpy()))
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

    def train(setting: str) -> tuple[str, str]:
        run = dtf("train", str(program), setting, home=home, timeout=400)
        assert run.returncode == 0, run.stderr[-4000:]
        assert "iterations 200 after" in run.stdout, run.stdout  # every step, and no more
        return run.stdout, run.stderr

    for setting in ("none", "auto"):
        out, err = train(setting)
        chosen = re.search(r"^dtf: packing (\d+) steps? per closure \(round trip ([\d.]+) ms", err, re.M)
        assert chosen, err[-3000:]
        print(f"{setting}: {chosen.group(0)}")
        assert int(chosen.group(1)) > 1 and float(chosen.group(2)) >= 20  # 24 ms added per round trip
        assert "after 1" in out  # the program's own value is back after fit
    for setting in ("1", "5"):
        out, err = train(setting)
        assert "dtf: packing" not in err
        assert f"after {setting}" in out
