"""NumPy arrays in model.fit, evaluate and predict under dtf.strategy() (no --wrap): validation
data, validation_split and none, then evaluate and predict (tests/e2e/test_wrap.py). With the
argument `nested`, a dict of arrays, which is refused in one line. Prints `numpy: ...` lines.
"""
import sys  # noqa: I001  (dtf before tensorflow: tf.keras is then tf-keras)

import dtf
import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 4)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
xv, yv = x[:300], y[:300]
strategy = dtf.strategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", input_shape=(4,)),
                                 tf.keras.layers.Dense(2)])
    model.compile(tf.keras.optimizers.Adam(0.01), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
if sys.argv[1:] == ["nested"]:
    model.fit({"features": x}, y, batch_size=64, epochs=1, verbose=0)
for name, kwargs in {"data": dict(validation_data=(xv, yv)), "split": dict(validation_split=0.1),
                     "none": {}}.items():
    before = int(model.optimizer.iterations.numpy())
    h = model.fit(x, y, batch_size=64, epochs=3, verbose=0, **kwargs)
    steps = int(model.optimizer.iterations.numpy()) - before
    loss = h.history["loss"]
    print(f"numpy: {name} steps {steps} keys {sorted(h.history)} learned {loss[-1] < loss[0]}", flush=True)
    if "val_accuracy" in h.history:
        print(f"numpy: {name} val_accuracy {h.history['val_accuracy'][-1]:.2f}", flush=True)
ev = model.evaluate(xv, yv, batch_size=64, verbose=0, return_dict=True)
print(f"numpy: evaluate accuracy {ev['accuracy']:.2f}", flush=True)
print(f"numpy: predict {model.predict(xv, verbose=0).shape}", flush=True)
