"""Keras `model.fit` on a ParameterServerStrategy cluster: a small CNN on 28x28 "digits".

    dtf train examples/mnist_fit.py            # on the cluster of `dtf up`
    python examples/mnist_fit.py               # no cluster: an in-process 1 ps + 2 worker cluster

The data is generated here (no download): 10 classes of pen strokes at different angles, with noise.
Writes checkpoints/, logs/ (TensorBoard), saved_model/ and summary.json under the output directory
(--output, else `dtf train --output`, else ./dtf-output).

Fault tolerance: a lost worker costs only time (the coordinator retries its steps elsewhere, and
takes it back when its supervisor has restarted it). A lost ps loses the variables: `dtf train`
runs this program again, and `dtf.BackupAndRestore()` (tf-keras BackupAndRestore, written on the
laptop) resumes `fit` at the epoch after the last one finished.
"""

import dtf  # first: makes tf.keras resolve to tf-keras (Keras 3 has no ParameterServerStrategy fit)

import argparse
import json
import os
import time

import numpy as np
import tensorflow as tf


def synthetic_digits(n, seed):
    """n "MNIST-like" 28x28x1 float images in [0, 1] and int labels 0-9, from a fixed seed.

    Class k is a soft pen stroke near the middle of the image at angle k * 18 degrees, jittered in
    angle, position and length, plus pixel noise: a small CNN learns it in a few hundred steps.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    angle = np.deg2rad(labels * 18.0 + rng.uniform(-5, 5, size=n))
    cy, cx = 13.5 + rng.uniform(-3, 3, size=(2, n))
    half = rng.uniform(7, 10, size=n)  # half the stroke length, in pixels
    yy, xx = np.mgrid[0:28, 0:28].astype(np.float32)
    dy, dx = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None]
    sin, cos = np.sin(angle)[:, None, None], np.cos(angle)[:, None, None]
    along = np.clip(dy * sin + dx * cos, -half[:, None, None], half[:, None, None])
    dist2 = (dy - along * sin) ** 2 + (dx - along * cos) ** 2  # squared distance to the stroke
    images = np.exp(-dist2 / 2.0) + rng.normal(0, 0.2, size=(n, 28, 28))
    return np.clip(images, 0, 1).astype(np.float32)[..., None], labels.astype(np.int64)


def make_model():
    return tf.keras.Sequential([
        tf.keras.layers.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),  # logits
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument("--steps-per-execution", type=int, default=10,
                        help="training steps packed into one remote call (one round trip)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--train-examples", type=int, default=4096)
    parser.add_argument("--eval-examples", type=int, default=1024)
    parser.add_argument("--output", help="output directory (default: dtf's, see dtf.output_dir)")
    parser.add_argument("--no-export", dest="export", action="store_false",
                        help="train and evaluate only: no SavedModel export, and no reload of it")
    args = parser.parse_args()
    if args.output:
        os.environ["DTF_OUTPUT_DIR"] = args.output  # dtf.output_dir() then writes there
    start = time.monotonic()

    strategy = dtf.strategy()
    # Global-batch rule: each step on a worker consumes one global batch, split over the worker's
    # replicas (1 on a CPU worker). Workers run steps independently (asynchronous training).
    global_batch = args.per_replica_batch * strategy.num_replicas_in_sync

    x_train, y_train = synthetic_digits(args.train_examples, seed=0)
    x_eval, y_eval = synthetic_digits(args.eval_examples, seed=1)  # held out: a different seed

    # A plain dataset built from numpy: Keras serializes it (data included) to every worker, and each
    # worker runs all of it, so it must shuffle and repeat forever; fit() needs steps_per_epoch.
    train_ds = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train), seed=0).repeat().batch(global_batch).prefetch(2))

    with strategy.scope():  # variables are created on the ps tasks
        model = make_model()
        model.compile(
            optimizer=tf.keras.optimizers.Adam(args.learning_rate),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            # Each remote call costs a round trip from this laptop to a worker: pack several steps
            # into one call (each scheduled call is one remote call to a worker:
            # tensorflow/python/distribute/coordinator/cluster_coordinator.py).
            steps_per_execution=args.steps_per_execution,
            # Exact evaluation: evaluate() splits the finite eval dataset into shards handed out to
            # workers. Without it, evaluate(finite_dataset) fails with OutOfRangeError on a worker
            # (every worker would run the whole dataset and run off its end).
            pss_evaluation_shards="auto",
        )

    class Progress(tf.keras.callbacks.Callback):
        """The one line per finished epoch (after its backup, so it also says where a resumed run
        picks up); fit's own progress lines are off (verbose=0): they would say the loss again."""

        def on_epoch_end(self, epoch, logs=None):
            print(f"epoch {epoch + 1}/{args.epochs} done: step {int(self.model.optimizer.iterations.numpy())}, "
                  f"loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.4f} "
                  f"(attempt {dtf.attempt()})", flush=True)

    callbacks = [
        # First: restores model, optimizer and epoch from the last backup if this is a resumed run,
        # and backs them up at the end of each epoch. Deleted when fit() completes.
        dtf.BackupAndRestore(),
        Progress(),  # right after the backup: a printed epoch is a backed-up epoch
        # Runs on this program (the coordinator): reads the variables from the ps and writes locally.
        # options: the save ops run here, not on the ps (whose disk is not the laptop's).
        tf.keras.callbacks.ModelCheckpoint(
            str(dtf.checkpoint_dir() / "ckpt-{epoch:02d}"), save_weights_only=True,
            options=dtf.checkpoint_options()),
        # Halve the learning rate every 2 epochs. (Only epoch-level callbacks are allowed under
        # ParameterServerStrategy: batch-level hooks raise a ValueError in fit.)
        tf.keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: args.learning_rate * 0.5 ** (epoch // 2)),
        # TensorBoard logs on the laptop: `tensorboard --logdir dtf-output/mnist_fit/logs`.
        tf.keras.callbacks.TensorBoard(str(dtf.output_dir("logs"))),
    ]

    history = model.fit(train_ds, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                        callbacks=callbacks, verbose=0)

    # The evaluation set as a function each worker calls to build it (a DatasetCreator): exact
    # evaluation shards it there (at least one batch per shard). A dataset made here from in-memory
    # tensors works too, with tf-keras' warning that it is "not efficiently shardable"
    # (tf_keras/src/engine/data_adapter.py).
    eval_input = tf.keras.utils.experimental.DatasetCreator(
        lambda context: tf.data.Dataset.from_tensor_slices((x_eval, y_eval)).batch(global_batch))
    evaluation = model.evaluate(eval_input, return_dict=True, verbose=0)

    # Export on the laptop: save_options() puts the writing on the coordinator (without it the ps
    # would write the variables to its own disk). Then reload it here, outside the strategy, and
    # check it predicts like the trained model.
    saved_model, reloaded_accuracy = dtf.output_dir() / "saved_model", None
    if args.export:
        model.save(str(saved_model), options=dtf.save_options())
        reloaded = tf.keras.models.load_model(str(saved_model))
        reloaded_accuracy = float(np.mean(reloaded.predict(x_eval, verbose=0).argmax(-1) == y_eval))

    summary = {
        "example": "mnist_fit",
        "global_batch": global_batch,
        "epochs": args.epochs,
        "steps": int(model.optimizer.iterations.numpy()),
        "attempt": dtf.attempt(),
        "epochs_this_attempt": len(history.epoch),  # fewer than epochs if this run resumed
        "first_loss": history.history["loss"][0],  # mean training loss of this attempt's first epoch
        "final_loss": history.history["loss"][-1],  # ... and of the last epoch
        "first_accuracy": history.history["accuracy"][0],
        "final_accuracy": history.history["accuracy"][-1],
        "loss_per_epoch": history.history["loss"],
        "learning_rates": [float(lr) for lr in history.history["lr"]],
        "eval_loss": float(evaluation["loss"]),
        "eval_accuracy": float(evaluation["accuracy"]),
        "saved_model": str(saved_model.resolve()) if args.export else None,
        "reloaded_eval_accuracy": reloaded_accuracy,
        "wall_seconds": round(time.monotonic() - start, 1),
    }
    summary_path = dtf.output_dir() / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"mnist_fit: {summary['steps']} steps, "
          f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}, "
          f"train accuracy {summary['final_accuracy']:.3f}, "
          f"eval accuracy {summary['eval_accuracy']:.3f}"
          + (f" (reloaded SavedModel: {reloaded_accuracy:.3f})" if args.export else " (not exported)") + "; "
          f"wrote {summary_path}")


if __name__ == "__main__":
    main()
