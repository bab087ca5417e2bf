"""`dtf train --wrap` on a local cluster: a single-machine Keras script, unchanged, learns."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from helpers import EXAMPLES, LOCAL_CLUSTER, dtf

PROGRAMS = Path(__file__).parent / "programs"

# The tests share the local cluster of tests/e2e/conftest.py (they only train on it).
pytestmark = [pytest.mark.tf, pytest.mark.slow, LOCAL_CLUSTER]


@pytest.fixture
def cluster(local_cluster) -> Path:
    return local_cluster[1]


def test_the_tutorial_script_trains_unchanged(cluster: Path):
    r = dtf("train", "--wrap", str(EXAMPLES / "wrap_mnist.py"), home=cluster, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    wrap_lines = [line for line in r.stderr.splitlines() if line.startswith("dtf: --wrap:")]
    assert len(wrap_lines) == 1, r.stderr[-4000:]
    assert "made a ParameterServerStrategy (2 workers, 1 ps)" in wrap_lines[0]
    assert re.search(r"^dtf: packing \d+ steps? per closure", r.stderr, re.M)
    epochs = [(float(a), float(b)) for a, b in re.findall(r"^70/70 - .*loss: ([\d.]+) - accuracy: ([\d.]+)",
                                                          r.stdout, re.M)]
    assert len(epochs) == 3, r.stdout
    assert epochs[-1][0] < epochs[0][0] and epochs[-1][1] > epochs[0][1], epochs  # it learns
    test = re.search(r"^test loss ([\d.]+), test accuracy ([\d.]+)", r.stdout, re.M)
    assert test and float(test.group(2)) > 0.3, r.stdout  # 10 classes: chance is 0.1


def test_the_tutorials_order_datasets_tensors_and_config_before_the_model(cluster: Path):
    """Made before the first layer (tf.config, a tensor and a variable at import, the training and
    the finite test dataset), used after it: --wrap connected the program to the cluster before
    its first op, so nothing names the local job (`/job:localhost ... unknown device`)."""
    r = dtf("train", "--wrap", str(PROGRAMS / "wrap_tutorial.py"), home=cluster, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "unknown device" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-4000:]
    wrap_lines = [line for line in r.stderr.splitlines() if line.startswith("dtf: --wrap:")]
    assert len(wrap_lines) == 1, r.stderr[-4000:]
    assert "made a ParameterServerStrategy (2 workers, 1 ps)" in wrap_lines[0]
    assert "steps_per_epoch=32 (its length)" in wrap_lines[0]
    test = re.search(r"^tutorial: test loss ([\d.]+), test accuracy ([\d.]+)", r.stdout, re.M)
    assert test and float(test.group(2)) > 0.5, r.stdout  # 4 classes: chance is 0.25
    assert "tutorial: scale 1.0, seen 512" in r.stdout  # the import-time tensor and variable
    assert "tutorial: inter-op threads 2" in r.stdout  # tf.config before the first op acted


MIRRORED = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    data = tf.data.Dataset.from_tensor_slices((np.ones((64, 4), "float32"), np.ones(64, "int64"))).batch(16)
    strategy = tf.distribute.MirroredStrategy()
    print("replicas", strategy.num_replicas_in_sync)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(4,))])
        model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, verbose=2)
    print("evaluated", round(float(model.evaluate(data, verbose=0)), 1) >= 0)
""")


def test_a_mirrored_strategy_of_its_own_is_refused_when_made(cluster: Path, tmp_path: Path):
    """A MirroredStrategy would train on this machine's devices, not on the cluster: one line with
    the fix, before anything trains, under --wrap as without it."""
    program = tmp_path / "mirrored.py"
    program.write_text(MIRRORED)
    for wrap in (["--wrap"], []):
        r = dtf("train", *wrap, str(program), home=cluster, timeout=300)
        assert r.returncode == 9, (wrap, r.stdout, r.stderr[-4000:])
        assert "replicas" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-4000:]
        errors = [line for line in r.stderr.splitlines() if line.startswith("dtf: error:")]
        fix = ("--wrap supplies the cluster's strategy: drop the MirroredStrategy and its scope, or make it with "
               "`dtf.strategy()` in its place" if wrap else
               "make the strategy with `dtf.strategy()` in its place, or drop it and run `dtf train --wrap "
               "PROGRAM` (a single-machine script)")
        assert errors == [
            "dtf: error: the program made a MirroredStrategy, which would train on this machine's devices, not on "
            f"the cluster; {fix} (mirrored.py:6)"], r.stderr[-4000:]


OWN_PSS_LOOP = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    # A custom loop with a ParameterServerStrategy the program makes itself, from TF_CONFIG (dtf sets it).
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(4,))])
        optimizer = tf.keras.optimizers.SGD(0.1)

    def dataset_fn():
        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, (x.sum(1) > 0).astype("int64"))).repeat().batch(16)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(iterator):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.run(replica, args=next(iterator))

    for _ in range(8):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    print("own strategy steps", int(optimizer.iterations.numpy()), flush=True)
    x, y = next(iter(dataset_fn()))
    with tf.GradientTape() as tape:  # a step here, on the coordinator: not on the workers
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    print("stepped here")
""")


def test_a_custom_loop_with_a_strategy_of_its_own_trains_on_the_cluster_and_not_here(cluster: Path, tmp_path: Path):
    program = tmp_path / "own_pss.py"
    program.write_text(OWN_PSS_LOOP)
    r = dtf("train", str(program), home=cluster, timeout=300)
    assert r.returncode == 9 and "stepped here" not in r.stdout, (r.stdout, r.stderr[-4000:])
    assert "own strategy steps 8" in r.stdout, (r.stdout, r.stderr[-4000:])  # scheduled: on the workers
    assert r.stderr.splitlines() == [
        "dtf: error: optimizer.apply_gradients would train on this machine, not on the cluster: the training step "
        "runs here, not in a function scheduled on the workers; schedule it (`dtf.coordinator().schedule(step)`, a "
        "tf.function with `strategy.run` inside), or use model.fit (own_pss.py:34)"], r.stderr[-4000:]


VARIANTS = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
    y = (x.sum(1) > 0).astype("int64")
    # Built and compiled at module level; a finite dataset; no steps_per_epoch; verbose=1.
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                 tf.keras.layers.Dense(2)])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).batch(32)
    model.fit(data, epochs=2, verbose=1)
    print("steps", int(model.optimizer.iterations.numpy()))
    result = model.evaluate(data, return_dict=True, verbose=0)
    print("evaluated", sorted(result))
    model.fit(data.repeat(), epochs=1)  # forever: what is missing is named
""")


def test_variants_are_supplied_or_named(cluster: Path, tmp_path: Path):
    program = tmp_path / "variants.py"
    program.write_text(VARIANTS)
    r = dtf("train", "--wrap", str(program), home=cluster, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr[-4000:])
    assert "steps 16" in r.stdout  # 2 epochs of the dataset's 8 batches, as on one machine
    assert "evaluated ['accuracy', 'loss']" in r.stdout
    line = next(x for x in r.stderr.splitlines() if x.startswith("dtf: --wrap:"))
    assert "steps_per_epoch=8 (its length)" in line and "verbose=1 -> 2" in line
    assert "validation" not in line  # there is none
    assert ("dtf: error: --wrap: model.fit on a dataset that repeats forever needs steps_per_epoch"
            in r.stderr)
    assert "Traceback" not in r.stderr


def test_every_validation_form_under_wrap(cluster: Path):
    """validation_split, numpy and tensor tuples, a dataset of fewer batches than exact evaluation's
    shards, and none: each fit validates (here, on the coordinator) with the right step counts;
    evaluate and predict agree on the same inputs."""
    r = dtf("train", "--wrap", str(PROGRAMS / "wrap_validation.py"), home=cluster, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "shard" not in r.stderr, r.stderr[-4000:]
    val_keys = "['accuracy', 'loss', 'val_accuracy', 'val_loss']"
    assert f"validation: split steps 15 keys {val_keys}" in r.stdout, r.stdout  # 900 examples at 64
    for form in ("numpy", "tensors", "dataset"):
        assert f"validation: {form} steps 16 keys {val_keys}" in r.stdout, r.stdout  # 1000 examples at 64
    assert "validation: none steps 16 keys ['accuracy', 'loss']" in r.stdout, r.stdout
    assert "validation: evaluate agree True" in r.stdout and "validation: predict [(500, 2)]" in r.stdout, r.stdout
    wrap_lines = [line for line in r.stderr.splitlines() if line.startswith("dtf: --wrap:")]
    assert "steps_per_epoch=15 (900 examples in batches of 64; 100 held out by validation_split)" in wrap_lines[0]
    assert "fit's validation runs here, on the coordinator" in wrap_lines[0]


KERAS3 = textwrap.dedent("""
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.fit(np.ones((64, 4), "float32"), np.ones((64, 2), "float32"), epochs=1, verbose=0)
    print("trained")
""")


@pytest.mark.parametrize("wrap", [True, False])
def test_a_keras3_model_is_refused_before_training(cluster: Path, tmp_path: Path, wrap: bool):
    program = tmp_path / "plain_k3.py"
    program.write_text(KERAS3)
    r = dtf("train", *(["--wrap"] if wrap else []), str(program), home=cluster, timeout=300)
    assert r.returncode == 9, (r.stdout, r.stderr[-4000:])
    assert "trained" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-4000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("dtf: error:")]
    assert len(errors) == 1 and errors[0].startswith("dtf: error: model.fit on a Keras 3 model (keras 3."), r.stderr
    assert "TF_USE_LEGACY_KERAS=1" in errors[0] and errors[0].endswith("(plain_k3.py:7)"), errors


PLAIN = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(4,))])
    model.compile("sgd", "mse")
    model.fit(np.ones((64, 4), "float32"), np.ones((64, 2), "float32"), epochs=1, verbose=0)
    print("trained")
""")


def test_a_single_machine_script_without_wrap_is_refused_at_its_first_fit(cluster: Path, tmp_path: Path):
    program = tmp_path / "plain.py"
    program.write_text(PLAIN)
    r = dtf("train", str(program), home=cluster, timeout=300)
    assert r.returncode == 9, (r.stdout, r.stderr[-4000:])
    assert "trained" not in r.stdout and "Traceback" not in r.stderr, r.stderr[-4000:]
    assert ("dtf: error: model.fit would train on this machine, not on the cluster: the model was made under no "
            "strategy; run `dtf train --wrap PROGRAM`") in r.stderr
    assert "(plain.py:7)" in r.stderr


def test_the_demo_example_prints_no_tensorflow_dataset_warning_and_no_line_twice(cluster: Path, tmp_path: Path):
    """`make demo`'s program: dtf's own example is quiet (no tf-keras "not efficiently shardable")."""
    r = dtf("train", str(EXAMPLES / "mnist_fit.py"), "--epochs", "2", "--steps-per-epoch", "10",
            "--output", str(tmp_path / "out"), home=cluster, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "shardable" not in r.stderr and "WARNING" not in r.stderr, r.stderr[-4000:]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), lines


def test_numpy_arrays_under_dtf_strategy_train_on_the_cluster_as_under_wrap(cluster: Path):
    """`model.fit(x, y, batch_size=64, validation_data=(xv, yv))` with NumPy arrays, a model built
    under dtf.strategy(): an epoch counted from the arrays, validation in both forms run on the
    coordinator, evaluate and predict on arrays; the training on the cluster's workers (dtf train
    stops a program that trains here). A dict of arrays is refused in one line."""
    r = dtf("train", str(PROGRAMS / "numpy_fit.py"), home=cluster, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-4000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("numpy:")]
    assert lines[:2] == ["numpy: data steps 48 keys ['accuracy', 'loss', 'val_accuracy', 'val_loss'] learned True",
                         lines[1]] and float(lines[1].split()[-1]) > 0.8, r.stdout
    assert lines[2] == "numpy: split steps 45 keys ['accuracy', 'loss', 'val_accuracy', 'val_loss'] learned True"
    assert lines[4:] == ["numpy: none steps 48 keys ['accuracy', 'loss'] learned True", lines[5],
                         "numpy: predict (300, 2)"] and float(lines[5].split()[-1]) > 0.8, r.stdout
    said = [line for line in r.stderr.splitlines() if line.startswith("dtf: fit:")]
    assert said == ["dtf: fit: steps_per_epoch=16 (1000 examples in batches of 64); fit's validation on arrays "
                    "runs here, on the coordinator (every example once)",
                    "dtf: fit: steps_per_epoch=15 (900 examples in batches of 64; 100 held out by validation_split)"]
    nested = dtf("train", str(PROGRAMS / "numpy_fit.py"), "nested", home=cluster, timeout=600)
    errors = [line for line in nested.stderr.splitlines() if line.startswith("dtf: error:")]
    assert nested.returncode == 2 and "Traceback" not in nested.stderr, nested.stderr[-4000:]
    assert errors == ["dtf: error: model.fit with x a dict of arrays (a model of several inputs): under "
                      "ParameterServerStrategy tf-keras takes a single array for x and for y; pass "
                      "tf.data.Dataset.from_tensor_slices((x, y)).batch(N) and steps_per_epoch instead "
                      "(numpy_fit.py:22)"], nested.stderr[-4000:]
