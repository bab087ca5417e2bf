"""Ctrl-C during `dtf train`'s model.fit on a local cluster: the program stops with dtf's one line,
no KeyboardInterrupt traceback (dtf.program.runner's excepthook)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers import LOCAL_CLUSTER, train_interrupted

pytestmark = [pytest.mark.tf, pytest.mark.slow, LOCAL_CLUSTER]

FITTING = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    x = np.ones((256, 4), "float32")
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(4,))])
    model.compile("sgd", "mse")

    class Started(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                print("training", flush=True)

    model.fit(x, x[:, :2], epochs=100000, verbose=0, callbacks=[Started()])  # until the Ctrl-C
""")


def test_ctrl_c_during_fit_prints_no_traceback(tmp_path: Path, local_cluster):
    _, home = local_cluster
    program = tmp_path / "fitting.py"
    program.write_text(FITTING)
    code, out, err = train_interrupted(home, "--wrap", str(program), timeout=120)
    assert code == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    assert "dtf: program interrupted; cluster 'loc' is still up (`dtf down` stops it)" in err, err[-4000:]
    assert "fit ended" not in err, err[-4000:]  # it was interrupted: nothing to say of how far packing got
