"""A single-machine tf-keras script that validates in every form stock Keras accepts, then
evaluates and predicts on the same inputs. No strategy and no dtf code: `dtf train --wrap` must
run it as `python` does (tests/e2e/test_wrap.py).

Prints `validation: ...` lines the test reads.
"""

import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 4)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
x_val, y_val = x[:500], y[:500]
small = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(64)  # 8 batches: fewer than exact evaluation's shards

model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)), tf.keras.layers.Dense(2)])
model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

forms = {
    "split": dict(x=x, y=y, validation_split=0.1),
    "numpy": dict(x=x, y=y, validation_data=(x_val, y_val)),
    "tensors": dict(x=x, y=y, validation_data=(tf.constant(x_val), tf.constant(y_val))),
    "dataset": dict(x=x, y=y, validation_data=small),
    "none": dict(x=x, y=y),
}
for name, kwargs in forms.items():
    before = int(model.optimizer.iterations.numpy())
    history = model.fit(batch_size=64, epochs=1, verbose=0, **kwargs)
    steps = int(model.optimizer.iterations.numpy()) - before
    print(f"validation: {name} steps {steps} keys {sorted(history.history)}", flush=True)

results = {
    "numpy": model.evaluate(x_val, y_val, batch_size=64, verbose=0, return_dict=True),
    "tensors": model.evaluate(tf.constant(x_val), tf.constant(y_val), batch_size=64, verbose=0, return_dict=True),
    "dataset": model.evaluate(small, verbose=0, return_dict=True),
}
agree = max(abs(r["loss"] - results["numpy"]["loss"]) for r in results.values()) < 1e-4
print(f"validation: evaluate agree {agree}", flush=True)
shapes = [model.predict(x_val, verbose=0).shape, model.predict(tf.constant(x_val), verbose=0).shape,
          model.predict(small, verbose=0).shape]
print(f"validation: predict {sorted(set(shapes))}", flush=True)
