"""A MultiWorkerMirroredStrategy program with SyncBatchNormalization, for `dtf train --collective`
(the test in test_collective.py).

Two models train one after the other on the same data: one with SyncBatchNormalization, one with
plain BatchNormalization, each normalizing the input itself. Every worker reads its own examples,
N(3 * worker index, 1) in each feature. Each copy then prints both layers' moving variances (the
layer's estimate of the variance of the batches it normalized, with momentum 0.5 so that 40
steps settle it):
- SyncBatchNormalization computes its statistics over the global batch, which spans the workers:
  with two workers, a variance of 1 + 1.5**2 = 3.25.
- Plain BatchNormalization uses each worker's own batch (variance 1); the replicas' updates are
  averaged, so it settles near 1 (the check that the test could fail).
"""

import json
import os

import numpy as np
import tensorflow as tf

import dtf


def model(norm):
    m = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(4,)),
        norm(momentum=0.5),
        tf.keras.layers.Dense(8, activation="relu"),
        tf.keras.layers.Dense(1),
    ])
    m.compile(optimizer=tf.keras.optimizers.SGD(0.02), loss="mse")
    return m


def main():
    strategy = dtf.strategy()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    rng = np.random.default_rng(task["index"])
    x = rng.normal(loc=3.0 * task["index"], size=(512, 4)).astype(np.float32)  # each worker its own data
    # One function of the input on every worker, which the model can learn (a target that depended
    # on the worker, as once here, could not be: the loss then barely moved, and once rose).
    y = np.tanh(x - 1.5).sum(axis=1, keepdims=True)

    def dataset(_ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

    sync_bn = getattr(tf.keras.layers.experimental, "SyncBatchNormalization", None) or (
        lambda **kw: tf.keras.layers.BatchNormalization(synchronized=True, **kw))
    with strategy.scope():
        synced, plain = model(sync_bn), model(tf.keras.layers.BatchNormalization)
    for name, m in [("synced", synced), ("plain", plain)]:
        data = strategy.distribute_datasets_from_function(dataset)
        history = m.fit(data, epochs=2, steps_per_epoch=20, verbose=0)
        bn = m.layers[0]
        print(f"{name} {type(bn).__name__} moving_variance {' '.join(f'{v:.4f}' for v in bn.moving_variance.numpy())}"
              f" loss {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
