"""dtf.program.hooks.roundtrips and the packing hook's own scheduling, on a local cluster: a fit's
metrics, reset and read in one call each, are the values each metric gives by itself; a metric
with a result of its own is still called eagerly; a closure's outputs copied in one call are its
outputs, whatever their number from one closure to the next; a packed fit runs every step and
leaves steps_per_execution as the program set it."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers import LOCAL_CLUSTER, dtf, listen_ports

pytestmark = [pytest.mark.tf, pytest.mark.slow]

PROGRAM = textwrap.dedent("""
    import json
    import dtf
    import numpy as np
    import tensorflow as tf

    strategy = dtf.strategy()
    eager_results = []  # Counted.result() calls outside a function being traced, outside Check

    class Counted(tf.keras.metrics.Metric):
        \"\"\"A metric with a result of its own (Python beside its TensorFlow ops).\"\"\"
        def __init__(self):
            super().__init__(name="counted")
            self.n = self.add_weight(name="n", initializer="zeros")
        def update_state(self, y_true, y_pred, sample_weight=None):
            self.n.assign_add(tf.cast(tf.shape(y_true)[0], tf.float32))
        def result(self):
            if tf.executing_eagerly() and not Check.inside:
                eager_results.append(1)
            return self.n * 1.0

    class Check(tf.keras.callbacks.Callback):
        inside = False
        epochs = []
        def on_epoch_end(self, epoch, logs=None):
            Check.inside = True
            try:  # each metric's own result, read eagerly now
                own = {m.name: float(m.result()) for m in self.model.metrics}
            finally:
                Check.inside = False
            Check.epochs.append({"logs": {k: float(v) for k, v in logs.items()}, "own": own})

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(8,)), tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", tf.keras.metrics.SparseTopKCategoricalAccuracy(k=2), Counted()])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = x[:, :4].argmax(1).astype("int64")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    model.fit(data, epochs=2, steps_per_epoch=30, verbose=0, callbacks=[Check()])
    packing = model.__dict__.get("_dtf_packing")
    cache = model.__dict__.get("_dtf_roundtrips") or {}
    model.reset_metrics()
    after_reset = [float(v.numpy()) for m in model.metrics for v in m.variables]

    with strategy.scope():
        v = tf.Variable(2.0)
    @tf.function
    def outputs():
        return {"a": v + 1.0, "b": tf.constant([1, 2, 3]), "c": tf.constant("x"), "d": (v * 2.0, v - 1.0)}
    remote = dtf.coordinator().schedule(outputs)
    dtf.coordinator().join()
    fetched = remote.fetch()
    eager_in_fit = len(eager_results)
    # closures of other numbers of outputs than fit's, of the same types: more of them, then fewer
    @tf.function
    def wide():
        return [v * float(i) for i in range(6)]
    remote_wide = dtf.coordinator().schedule(wide)
    dtf.coordinator().join()
    fetched_wide = [float(t) for t in remote_wide.fetch()]
    evaluated = model.evaluate(data, steps=6, return_dict=True, verbose=0)

    print("RESULT " + json.dumps({
        "epochs": Check.epochs, "eager_results": eager_in_fit, "after_reset": after_reset,
        "kinds": sorted({key[0] for key in cache}), "direct": bool(packing and packing.direct),
        "iterations": int(model.optimizer.iterations.numpy()), "spe": int(model._steps_per_execution.numpy()),
        "fetched": {"a": float(fetched["a"]), "b": fetched["b"].tolist(), "c": fetched["c"].decode(),
                    "d": [float(t) for t in fetched["d"]]},
        "wide": fetched_wide, "evaluated": sorted(evaluated)}))
""")


@LOCAL_CLUSTER
def test_metrics_in_one_call_are_each_metrics_own_values_and_a_packed_fit_runs_every_step(
        tmp_path: Path, local_cluster):
    _, home = local_cluster
    check(home, tmp_path)


def test_the_same_with_metrics_spread_over_two_ps(tmp_path: Path):
    """Round-robin placement puts a metric's variables on either ps; no ps knows the other (device
    filters): one call over both comes from the coordinator."""
    ps0, ps1, w0, w1 = listen_ports(4)
    inventory = tmp_path / "two-ps.yaml"
    inventory.write_text(f"cluster: twops\nhosts:\n  - host: localhost\n    connection: local\n"
                         f"    workdir: {tmp_path / 'work'}\n    ps: [{ps0}, {ps1}]\n    workers: [{w0}, {w1}]\n")
    home = tmp_path / "home"
    assert dtf("up", str(inventory), home=home).returncode == 0
    try:
        check(home, tmp_path)
    finally:
        assert dtf("down", home=home).returncode == 0


def check(home: Path, tmp_path: Path) -> None:
    program = tmp_path / "fit.py"
    program.write_text(PROGRAM)
    r = dtf("train", str(program), home=home, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    line = next((line for line in r.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line, (r.stdout[-3000:], r.stderr[-3000:])
    result = json.loads(line[len("RESULT "):])
    assert result["kinds"] == ["reset", "results"]  # dtf's calls were made
    assert len(result["epochs"]) == 2
    for epoch in result["epochs"]:
        # fit's logs (dtf's one call) are, exactly, what each metric says by itself
        assert epoch["logs"] == epoch["own"], epoch
        assert set(epoch["own"]) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy", "counted"}
        assert epoch["own"]["counted"] == 30 * 16  # reset at the epoch's start: this epoch's examples only
    assert result["eager_results"] == 2  # the metric with its own result: eagerly, at each epoch end
    assert result["after_reset"] and all(value == 0.0 for value in result["after_reset"])
    assert result["fetched"] == {"a": 3.0, "b": [1, 2, 3], "c": "x", "d": [4.0, 1.0]}
    assert result["direct"] and result["iterations"] == 60 and result["spe"] == 1
    assert result["wide"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert result["evaluated"] == ["accuracy", "counted", "loss", "sparse_top_k_categorical_accuracy"]
