"""Item 4 of issue 9: the guard rails (dtf.program.hooks.guards), on the in-process cluster: the programs
run as `dtf train` runs them (`python -m dtf.program.runner`), without a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.tf
KERAS = version("keras")


def run(tmp_path: Path, program: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(program))
    return subprocess.run([sys.executable, "-m", "dtf.program.runner", str(path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env})


def dtf_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("dtf: ") and "in-process cluster" not in line]


SSH_MODE = """
    import dtf
    import numpy as np
    import tensorflow as tf

    strategy, coordinator = dtf.strategy(), dtf.coordinator()
    with strategy.scope():  # a stock tf-keras fit: nothing to warn about
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.ones((64, 4), "float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :2])).repeat().batch(8), epochs=1, steps_per_epoch=4, verbose=0)
    print("fit done", flush=True)

    outside = tf.Variable(1.0)  # on the coordinator
    @tf.function
    def step():
        return outside + 1.0
    coordinator.schedule(step)
    coordinator.schedule(step)
    coordinator.join()

    def dataset_fn():
        return tf.data.Dataset.range(4).map(lambda i: tf.py_function(lambda v: v * 2, [i], tf.int64))
    coordinator.create_per_worker_dataset(dataset_fn)
    coordinator.create_per_worker_dataset(tf.data.Dataset.from_generator(lambda: iter(range(3)), output_types=tf.int64))
    print("warned", flush=True)

    big = np.zeros((20000, 4), "float32")  # with its labels 480 kB, over the limit of the ssh test
    model.fit(tf.data.Dataset.from_tensor_slices((big, big[:, :2])).repeat().batch(8), epochs=1, steps_per_epoch=2, verbose=0)
    print("not reached")
"""


def test_ssh_mode_warns_of_callbacks_once_each_and_a_dataset_over_the_limit_stops_the_program(tmp_path: Path):
    r = run(tmp_path, SSH_MODE, DTF_NETWORK="ssh", DTF_DATASET_LIMIT="300000")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["fit done", "warned"], r.stdout + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = dtf_lines(r)
    assert len(lines) == 3, lines
    assert lines[0].startswith("dtf: warning: a scheduled function uses a variable or resource made outside strategy.scope()")
    assert lines[0].endswith("(prog.py:18)")
    assert lines[1].startswith("dtf: warning: the dataset runs Python (Dataset.from_generator, tf.py_function")
    assert lines[1].endswith("(prog.py:24)")
    assert lines[2].startswith("dtf: error: the dataset holds 0.5 MB of in-memory data")
    assert "DTF_DATASET_LIMIT=300000" in lines[2] and lines[2].endswith("(prog.py:29)")


def test_direct_mode_does_not_warn_of_callbacks_and_a_dataset_fn_over_the_limit_stops_the_program(tmp_path: Path):
    # Keras 3 imported beside tf-keras (tf.keras): a warning, and the program goes on.
    program = SSH_MODE.replace("import dtf", "import keras\n    import dtf", 1) + """
    def dataset_fn():  # in-memory data in a dataset_fn: constants of the function sent to the workers
        return tf.data.Dataset.from_tensor_slices(np.zeros((100000, 4), "float32"))
    coordinator.create_per_worker_dataset(dataset_fn)
    print("not reached either")
    """
    r = run(tmp_path, program, DTF_NETWORK="direct", DTF_DATASET_LIMIT="1000000")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["fit done", "warned", "not reached"]
    assert dtf_lines(r) == [
        f"dtf: warning: the program imported Keras 3 (keras {KERAS}): models made with it cannot fit "
        "under ParameterServerStrategy; use tf.keras (tf-keras under dtf train) or `import tf_keras` (prog.py:7)",
        "dtf: error: the dataset holds 1.6 MB of in-memory data, and TensorFlow sends a dataset to every worker as one "
        "graph of at most 2 GB (DTF_DATASET_LIMIT=1e+06): write the data to files and read them on the workers, in a "
        "dataset_fn (e.g. TFRecord) (prog.py:35)"]


def test_keras_3_as_tf_keras_stops_the_program_when_the_strategy_is_made(tmp_path: Path):
    r = run(tmp_path, """
        import os
        os.environ["TF_USE_LEGACY_KERAS"] = "0"  # the program undoes what dtf train set
        import keras
        import dtf
        dtf.strategy()
        print("not reached")
    """)
    assert r.returncode == 1 and "not reached" not in r.stdout, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert dtf_lines(r) == [
        f"dtf: error: tf.keras is Keras 3 ({KERAS}), whose Model.fit cannot train under "
        "ParameterServerStrategy: leave TF_USE_LEGACY_KERAS=1 (dtf train sets it) so that tf.keras is tf-keras (prog.py:6)"]


CUSTOM_LOOP_HERE = """
    import numpy as np
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(2)])
    optimizer = tf.keras.optimizers.SGD()
    x = np.ones((8, 4), "float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    print("stepped")
"""
# What `dtf train` gives the program (dtf.program.train.program_env); no strategy is made, so no cluster is needed.
UNDER_DTF_TRAIN = {"DTF_CLUSTER": "c", "TF_CONFIG": '{"cluster": {}, "task": {"type": "chief", "index": 0}}'}


def test_a_custom_loop_under_no_strategy_is_refused_at_its_first_step_under_dtf_train(tmp_path: Path):
    r = run(tmp_path, CUSTOM_LOOP_HERE, **UNDER_DTF_TRAIN)
    assert r.returncode == 9 and "stepped" not in r.stdout, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = dtf_lines(r)
    assert len(lines) == 1 and lines[0].startswith(
        "dtf: error: optimizer.apply_gradients would train on this machine, not on the cluster"), lines
    assert "dtf.coordinator().schedule(step)" in lines[0] and lines[0].endswith("(prog.py:10)"), lines
    plain = run(tmp_path, CUSTOM_LOOP_HERE)  # `python prog.py`, or a collective copy: its choice
    assert plain.returncode == 0 and "stepped" in plain.stdout, plain.stderr[-3000:]
    collective = run(tmp_path, CUSTOM_LOOP_HERE, **UNDER_DTF_TRAIN, DTF_COLLECTIVE="1")
    assert collective.returncode == 0 and "stepped" in collective.stdout, collective.stderr[-3000:]


WORKERS_OWN_DISKS = """
    import dtf
    import tensorflow as tf

    strategy, coordinator = dtf.strategy(), dtf.coordinator()
    def dataset_fn():
        return tf.data.TextLineDataset("/nonexistent/on/the/workers.csv").repeat()
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    @tf.function
    def step(iterator):
        return next(iterator)
    coordinator.schedule(step, args=(iterator,))
    coordinator.join()
"""


def test_a_file_the_workers_do_not_have_is_one_line(tmp_path: Path):
    r = run(tmp_path, WORKERS_OWN_DISKS)
    assert r.returncode == 1, r.stderr[-3000:]
    assert dtf_lines(r) == [
        "dtf: error: a worker could not open /nonexistent/on/the/workers.csv: No such file or directory. The workers "
        "read their own disks, not this machine's: copy the data to them with `dtf sync DIR` and open it in the "
        "program at `dtf.synced(NAME)` (or give a path that exists on every worker) (prog.py:13)"]
    assert "Traceback" not in r.stderr and "Detected at node" not in r.stderr, r.stderr[-3000:]


EXACT_EVALUATION = """
    import dtf
    import numpy as np
    import tensorflow as tf

    strategy = dtf.strategy()
    x, y = np.ones((500, 4), "float32"), np.ones(500, "int64")
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(2)])
        model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      pss_evaluation_shards="auto")
    train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64)
    val = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # 8 batches, 10 shards (5 per worker)
    model.fit(train, epochs=1, steps_per_epoch=2, validation_data=val, verbose=0)
    print("not reached")
"""


def test_exact_evaluation_of_fewer_batches_than_shards_is_refused_before_fit(tmp_path: Path):
    r = run(tmp_path, EXACT_EVALUATION)
    assert r.returncode == 1 and "not reached" not in r.stdout, r.stderr[-3000:]
    assert dtf_lines(r) == [
        "dtf: error: exact evaluation splits fit's validation_data into 10 shards (pss_evaluation_shards), and it "
        "has 8 batches: TensorFlow cannot shard it on the workers (\"Could not apply FILE based sharding\"); compile "
        "with pss_evaluation_shards=8 or less, use smaller batches, or run a single-machine script with "
        "`dtf train --wrap` (it evaluates on the coordinator) (prog.py:14)"]
    assert "Traceback" not in r.stderr


def test_a_program_that_never_made_a_strategy_is_an_error_at_its_end_under_dtf_train(tmp_path: Path):
    loop = """
        import tensorflow as tf

        w = tf.Variable(1.0)
        for _ in range(3):  # a loop of its own: no Keras, no optimizer
            w.assign_sub(0.1 * w)
        print("looped")
    """
    r = run(tmp_path, loop, **UNDER_DTF_TRAIN)
    assert r.returncode == 9 and "looped" in r.stdout, r.stderr[-3000:]
    assert dtf_lines(r) == [
        "dtf: error: the program ended without making a strategy: nothing ran on the cluster; run `dtf train --wrap "
        "PROGRAM` (a single-machine script, unchanged), or build and compile the model inside "
        "`with dtf.strategy().scope():`"]
    ended = run(tmp_path, loop + "    raise SystemExit(0)  # sys.exit(main()), main's end\n", **UNDER_DTF_TRAIN)
    assert ended.returncode == 9 and dtf_lines(ended) == dtf_lines(r), ended.stderr[-3000:]
    no_tf = run(tmp_path, "print('no TensorFlow here')\n", **UNDER_DTF_TRAIN)
    assert no_tf.returncode == 0 and dtf_lines(no_tf) == [], no_tf.stderr[-3000:]


@pytest.mark.parametrize(("made", "fix"), [
    ("tf.distribute.MirroredStrategy()", "make the strategy with `dtf.strategy()` in its place, or drop it and run "
                                         "`dtf train --wrap PROGRAM`"),
    ("tf.distribute.OneDeviceStrategy('/cpu:0')", "make the strategy with `dtf.strategy()` in its place"),
    ("tf.distribute.MultiWorkerMirroredStrategy()", "run it with `dtf train --collective PROGRAM`"),
])
def test_a_strategy_of_its_own_that_would_train_here_is_refused_when_made_under_dtf_train(
        tmp_path: Path, made: str, fix: str):
    program = f"""
        import tensorflow as tf

        strategy = {made}
        print("made", flush=True)
    """
    r = run(tmp_path, program, **UNDER_DTF_TRAIN)
    assert r.returncode == 9 and "made" not in r.stdout, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = dtf_lines(r)
    assert len(lines) == 1 and lines[0].startswith("dtf: error: the program made a "), lines
    assert fix in lines[0] and lines[0].endswith("(prog.py:4)"), lines
    plain = run(tmp_path, program.replace("MultiWorkerMirroredStrategy()", "MirroredStrategy()"))  # `python prog.py`
    assert plain.returncode == 0 and "made" in plain.stdout, plain.stderr[-3000:]


def test_tf_keras_made_keras_3_by_the_program_is_refused_naming_its_setting(tmp_path: Path):
    """The program sets TF_USE_LEGACY_KERAS=0 before importing TensorFlow: tf.keras is Keras 3."""
    program = """
        import os
        os.environ["TF_USE_LEGACY_KERAS"] = "0"
        import numpy as np
        import tensorflow as tf

        model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), verbose=0)
        print("trained")
    """
    r = run(tmp_path, program, **UNDER_DTF_TRAIN, TF_USE_LEGACY_KERAS="1")
    assert r.returncode == 9 and "trained" not in r.stdout, r.stderr[-3000:]
    assert dtf_lines(r) == [
        f"dtf: error: model.fit on a Keras 3 model (keras {KERAS}): Keras 3 cannot train under "
        f"ParameterServerStrategy (keras-team/keras#18624), so it would train on this machine; use tf-keras: "
        f"`tf.keras` with TF_USE_LEGACY_KERAS=1 (the program set it to '0': leave it as dtf train sets it) or "
        f"`import tf_keras as keras` in place of `import keras` (prog.py:9)"], r.stderr[-3000:]
