"""The "Multi-worker training with Keras" tutorial's worker, for `dtf train --collective`.

    dtf train --collective examples/simple_worker_mnist.py [--epochs 3] [--steps 70]

Every worker runs this same file with its own TF_CONFIG (dtf sets it); worker 0 is the chief.
As in the tutorial: a MultiWorkerMirroredStrategy from TF_CONFIG, a global batch of
per_worker_batch_size * num_workers, a small CNN built and compiled inside strategy.scope(),
model.fit, and a save where the chief writes to the real path and the others to temporary
directories they delete. The data is made here instead of `mnist.load_data()` (no download): 28x28
"digits" whose class is the angle of a pen stroke, learnable by a small CNN in a few epochs.

Relative paths land in the task's output directory (its working directory): the chief's
(keras-model/, backup/, epochs.txt, summary.json) comes back to the laptop's --output.
BackupAndRestore makes a restarted run (`--attempts`) resume at the epoch after the last one
finished.
"""

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf


def synthetic_mnist(n, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    angle = np.deg2rad(labels * 18.0 + rng.uniform(-5, 5, size=n))
    cy, cx = 13.5 + rng.uniform(-3, 3, size=(2, n))
    half = rng.uniform(7, 10, size=n)
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32)
    dy, dx = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None]
    sin, cos = np.sin(angle)[:, None, None], np.cos(angle)[:, None, None]
    along = np.clip(dy * sin + dx * cos, -half[:, None, None], half[:, None, None])
    images = np.exp(-((dy - along * sin) ** 2 + (dx - along * cos) ** 2) / 2.0) + rng.normal(0, 0.2, (n, 28, 28))
    return np.clip(images * 255, 0, 255).astype(np.uint8), labels.astype(np.int64)


def mnist_dataset(batch_size):
    x_train, y_train = synthetic_mnist(4096)
    x_train = x_train / np.float32(255)
    return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(4096).repeat().batch(batch_size)


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9), metrics=["accuracy"])
    return model


def _is_chief(task_type, task_id):
    return task_type is None or task_type == "chief" or (task_type == "worker" and task_id == 0)


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


class EpochLog(tf.keras.callbacks.Callback):
    """Appends "attempt N epoch E" to epochs.txt at each epoch's end (and sleeps, to be killable);
    says "first step done" once."""

    def __init__(self, path, sleep):
        super().__init__()
        self.path, self.sleep, self.stepped = path, sleep, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.stepped:
            self.stepped = True
            print("first step done", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(f"attempt {os.environ.get('DTF_ATTEMPT', '1')} epoch {epoch} loss {logs['loss']:.4f}\n")
        print(f"epoch {epoch} done", flush=True)
        time.sleep(self.sleep)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--epoch-sleep", type=float, default=0.0)
    options = parser.parse_args()

    per_worker_batch_size = 64
    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_dataset(global_batch_size)
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()

    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    chief = _is_chief(task_type, task_id)
    callbacks = [tf.keras.callbacks.BackupAndRestore("backup")]
    if chief:
        callbacks.append(EpochLog("epochs.txt", options.epoch_sleep))
    history = multi_worker_model.fit(multi_worker_dataset, epochs=options.epochs, steps_per_epoch=options.steps,
                                     callbacks=callbacks, verbose=2)

    model_path = "keras-model"
    write_model_path = write_filepath(model_path, task_type, task_id)
    multi_worker_model.save(write_model_path)
    if not chief:
        tf.io.gfile.rmtree(os.path.dirname(write_model_path))
    else:
        with open("summary.json", "w") as f:
            json.dump({"loss": history.history["loss"], "workers": num_workers}, f)


if __name__ == "__main__":
    main()
