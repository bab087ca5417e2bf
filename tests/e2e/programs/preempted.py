"""A custom training loop with TensorFlow's PreemptionCheckpointHandler, for `dtf train
--collective` (the Ctrl-C test in test_collective.py).

It trains until it is stopped: SIGTERM on any copy is TensorFlow's preemption notice outside
Google's clouds, and the handler then saves a checkpoint (the chief in ./ckpt, the others in
temporary directories it removes) at the same step on every worker, and exits.
"""

import time

import numpy as np
import tensorflow as tf

import dtf


def main():
    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(4,)), tf.keras.layers.Dense(1)])
        optimizer = tf.keras.optimizers.SGD(0.01)
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    data = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32))
    iterator = iter(data)

    @tf.function
    def train_step(it):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.reduce("MEAN", strategy.run(step, args=next(it)), axis=None)

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(strategy.cluster_resolver, checkpoint, "ckpt")
    step = handler.total_run_calls
    print(f"starting at step {step}", flush=True)
    while True:
        loss = handler.run(train_step, iterator)
        step += 1
        if step % 10 == 0:
            print(f"step {step} loss {float(loss):.4f}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
