"""A single-machine Keras script, with no strategy and no dtf code: run it with `dtf train --wrap`.

    python examples/wrap_mnist.py                  # one machine, as written
    dtf train --wrap examples/wrap_mnist.py        # the same script, on the cluster of `dtf up`

It is TensorFlow's "Multi-worker training with Keras" tutorial's single-worker program
(mnist_dataset, build_and_compile_cnn_model, fit for 3 epochs of 70 steps), with two changes: the
data is made here (no download: `load_data` below stands in for tf.keras.datasets.mnist), and it
evaluates the model on held-out data at the end. Its datasets, the held-out one included, are
made before the model, as scripts usually do: `--wrap` connects the program to the cluster before
its first op, so they are usable after the strategy is made.
"""

import numpy as np
import tensorflow as tf


def load_data(n_train=6000, n_test=1000, seed=0):
    """A stand-in for tf.keras.datasets.mnist.load_data(): uint8 28x28 images and labels 0-9.

    Class k is a bright 8x8 square at one of 10 places on the image (with jitter), over noise.
    """
    rng = np.random.default_rng(seed)

    def make(n):
        labels = rng.integers(0, 10, size=n)
        images = rng.integers(0, 90, size=(n, 28, 28))
        row = 2 + 12 * (labels // 5) + rng.integers(0, 3, size=n)
        col = 1 + 5 * (labels % 5) + rng.integers(0, 2, size=n)
        for i in range(n):
            images[i, row[i]:row[i] + 8, col[i]:col[i] + 8] += 160
        return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.uint8)

    return make(n_train), make(n_test)


def mnist_dataset(batch_size):
    (x_train, y_train), _ = load_data()
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])
    return model


batch_size = 64
single_worker_dataset = mnist_dataset(batch_size)
_, (x_test, y_test) = load_data()
test_dataset = tf.data.Dataset.from_tensor_slices((x_test / np.float32(255), y_test.astype(np.int64))).batch(batch_size)
single_worker_model = build_and_compile_cnn_model()
single_worker_model.fit(single_worker_dataset, epochs=3, steps_per_epoch=70)
loss, accuracy = single_worker_model.evaluate(test_dataset)
print(f"test loss {loss:.4f}, test accuracy {accuracy:.4f}")
