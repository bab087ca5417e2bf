"""A single-machine tf-keras script in the order TensorFlow's tutorials (and most scripts) use:
`tf.config` first, a tensor and a variable at import, the datasets (training and a finite test
set), then the model, fit, and evaluate on the test set made before the model. No strategy and
no dtf code: `dtf train --wrap` must run it as `python` does (tests/e2e/test_wrap.py).

Prints `tutorial: ...` lines the test reads.
"""

import numpy as np
import tensorflow as tf

# Before TensorFlow's runtime starts, as on one machine (afterwards it raises RuntimeError).
tf.config.threading.set_inter_op_parallelism_threads(2)

scale = tf.constant(1 / 255, dtype=tf.float32)  # a tensor made at import, used after the model
seen = tf.Variable(0, dtype=tf.int64)  # a variable made before the model, updated after it

rng = np.random.default_rng(0)


def make(n):
    labels = rng.integers(0, 4, size=n)
    images = rng.integers(0, 90, size=(n, 8, 8))
    for i, k in enumerate(labels):
        images[i, 4 * (k // 2):4 * (k // 2) + 4, 4 * (k % 2):4 * (k % 2) + 4] += 160
    return images.astype(np.uint8), labels.astype(np.int64)


(x_train, y_train), (x_test, y_test) = make(2048), make(512)
train_dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                 .map(lambda x, y: (tf.cast(x, tf.float32) * scale, y)).shuffle(2048).batch(64))
test_dataset = (tf.data.Dataset.from_tensor_slices((x_test, y_test))
                .map(lambda x, y: (tf.cast(x, tf.float32) * scale, y)).batch(64))

model = tf.keras.Sequential([
    tf.keras.layers.Flatten(input_shape=(8, 8)),
    tf.keras.layers.Dense(32, activation="relu"),
    tf.keras.layers.Dense(4),
])
model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
model.fit(train_dataset, epochs=3)

loss, accuracy = model.evaluate(test_dataset, verbose=2)
print(f"tutorial: test loss {loss:.4f}, test accuracy {accuracy:.4f}")
seen.assign_add(sum(int(y.shape[0]) for _, y in test_dataset))
print(f"tutorial: scale {float(scale * 255):.1f}, seen {int(seen.numpy())}")
print(f"tutorial: inter-op threads {tf.config.threading.get_inter_op_parallelism_threads()}")
