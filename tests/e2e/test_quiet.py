"""Item 5 of issue 9: `dtf train` shows the program's output and errors, not TensorFlow's chatter
(unless --verbose). On a local cluster (`connection: local`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers import LOCAL_CLUSTER, NOISE, dtf

pytestmark = pytest.mark.tf

PROGRAM = textwrap.dedent("""
    import sys
    import dtf
    import tensorflow as tf
    strategy, coordinator = dtf.strategy(), dtf.coordinator()
    with strategy.scope():
        v = tf.Variable(0.0)
    @tf.function
    def step():
        v.assign_add(1.0)
    for _ in range(5):
        coordinator.schedule(step)
    coordinator.join()
    tf.train.Checkpoint(v=v).write("ckpt")  # the save function TensorFlow retraces at each save
    tf.train.Checkpoint(v=v).write("ckpt")
    print("counted", int(v.numpy()), flush=True)
    print("the program's own warning", file=sys.stderr, flush=True)
    raise RuntimeError("the program's own error")
""")
CHATTER = [*NOISE, "Ignoring error status when releasing multi-device function handle"]


@pytest.fixture
def cluster(local_cluster) -> Path:
    """The local cluster of tests/e2e/conftest.py (shared: this test only trains on it)."""
    return local_cluster[1]


@LOCAL_CLUSTER
def test_the_program_speaks_and_tensorflow_only_with_verbose(tmp_path: Path, cluster: Path):
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    quiet = dtf("train", str(program), home=cluster, cwd=tmp_path)
    loud = dtf("train", "--verbose", str(program), home=cluster, cwd=tmp_path)
    for r in (quiet, loud):
        assert r.returncode == 1, r.stderr[-3000:]
        assert r.stdout == "counted 5\n"
        assert "the program's own warning\n" in r.stderr
        assert "Traceback (most recent call last)" in r.stderr
        assert r.stderr.rstrip().endswith("RuntimeError: the program's own error")
    assert [c for c in CHATTER if c in quiet.stderr] == [], quiet.stderr
    assert [c for c in CHATTER if c in loud.stderr] != [], loud.stderr


LAPTOP_FILE = textwrap.dedent("""
    import dtf
    import tensorflow as tf

    strategy = dtf.strategy()
    def dataset_fn(context):  # a file only this machine has (not synced to the hosts)
        return tf.data.TextLineDataset(LAPTOP_ONLY).repeat().batch(4).map(
            lambda line: (tf.ones((4, 8)), tf.zeros((4,), "int64")))
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(8,))])
        model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), steps_per_epoch=20, epochs=1, verbose=2)
    print("not reached")
""")


@LOCAL_CLUSTER
def test_a_file_only_the_laptop_has_is_one_line_under_dtf_train(tmp_path: Path, cluster: Path):
    """The workers fail to open it, closures are cancelled one after another: what `dtf train`
    prints is one line, with the way out (dtf sync, dtf.synced())."""
    missing = tmp_path / "not-on-the-hosts" / "data.csv"
    program = tmp_path / "laptop_file.py"
    program.write_text(LAPTOP_FILE.replace("LAPTOP_ONLY", repr(str(missing))))
    r = dtf("train", str(program), home=cluster, cwd=tmp_path)
    assert r.returncode == 1 and "not reached" not in r.stdout, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        f"dtf: error: a worker could not open {missing}: No such file or directory. The workers read their own "
        f"disks, not this machine's: copy the data to them with `dtf sync DIR` and open it in the program at "
        f"`dtf.synced(NAME)` (or give a path that exists on every worker) (laptop_file.py:12)"], r.stderr[-3000:]
