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
