"""A stock tf-keras pipeline, as a user brings it: no dtf helpers, its own ParameterServerStrategy
from TF_CONFIG, every output path relative to the working directory. Under `dtf train` every file
it writes must land on the laptop (dtf.program.hooks.saving), whatever the hosts' disks.

Prints `stock: ok ...` at the end; `--explicit-none` then also saves once with an explicit
`experimental_io_device=None` (TensorFlow's own placement: next to the variables, on the ps) and
prints what that did.
"""

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np
import tensorflow as tf

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(resolver)

rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int64")
train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).repeat().batch(32)

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(8,)),
                                 tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-2),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=5, pss_evaluation_shards="auto")

callbacks = [
    tf.keras.callbacks.BackupAndRestore("./backup", delete_checkpoint=False),
    tf.keras.callbacks.ModelCheckpoint("./training_checkpoints/ckpt_{epoch}", save_weights_only=True),
    tf.keras.callbacks.ModelCheckpoint("./models/model_{epoch}"),  # whole model: a SavedModel
    tf.keras.callbacks.TensorBoard("./logs"),
    tf.keras.callbacks.LearningRateScheduler(lambda epoch, lr: 1e-2 * 0.5 ** epoch),
]
model.fit(train, epochs=2, steps_per_epoch=10, callbacks=callbacks, verbose=2)

model.load_weights(tf.train.latest_checkpoint("./training_checkpoints"))
evaluation = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), return_dict=True, verbose=0)
model.save_weights("./weights/w")
model.load_weights("./weights/w")
model.save("./saved_model")

manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model), "./manager", max_to_keep=2)
manager.save()
manager.checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
reloaded = tf.keras.models.load_model("./saved_model")
print(f"stock: ok, eval accuracy {evaluation['accuracy']:.2f}, reloaded {len(reloaded.weights)} weights", flush=True)

if "--explicit-none" in sys.argv:
    try:
        tf.train.Checkpoint(model=model).write(
            "./explicit/ckpt", options=tf.train.CheckpointOptions(experimental_io_device=None))
        print("explicit None: saved", flush=True)
    except tf.errors.OpError as e:
        print(f"explicit None: {type(e).__name__}: {e.message.splitlines()[0]}", flush=True)
