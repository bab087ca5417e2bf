"""A custom training loop on a ParameterServerStrategy cluster, driven by a ClusterCoordinator.

    dtf train examples/custom_loop.py          # on the cluster of `dtf up`
    python examples/custom_loop.py             # no cluster: an in-process 1 ps + 2 worker cluster

This program (the coordinator) only schedules functions; the workers run them, each on its own copy
of the dataset, reading and updating the variables that live on the ps tasks. The data is generated
here (no download): 10 classes of pen strokes at different angles, with noise. Writes checkpoints/
and summary.json under the output directory (--output, else `dtf train --output`, else ./dtf-output).

Fault tolerance: the loop keeps its own step counter (a variable, checkpointed with the model and
optimizer after every epoch). A lost ps loses the variables: `dtf train` runs this program again,
which restores the last checkpoint and runs exactly the steps still missing.
"""

import dtf  # first: makes tf.keras resolve to tf-keras (Keras 3 has no PS strategy: keras-team/keras#18624)

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=50)
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=None,
                        help="training steps run by one scheduled function (one round trip); "
                             "default: dtf measures the round trip and a step, and chooses")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--train-examples", type=int, default=4096)
    parser.add_argument("--output", help="output directory (default: dtf's, see dtf.output_dir)")
    args = parser.parse_args()
    if args.output:
        os.environ["DTF_OUTPUT_DIR"] = args.output  # dtf.output_dir() then writes there
    start = time.monotonic()

    strategy = dtf.strategy()
    coordinator = dtf.coordinator()
    # Global-batch rule: each step on a worker consumes one global batch, split over the worker's
    # replicas (1 on a CPU worker). Workers run steps independently (asynchronous training).
    global_batch = args.per_replica_batch * strategy.num_replicas_in_sync

    x_train, y_train = synthetic_digits(args.train_examples, seed=0)

    def dataset_fn(input_context):
        # Runs on EACH worker (the arrays travel inside the dataset's graph). Every worker reads all
        # of it, in its own order: shuffle, and repeat forever (the loop decides when to stop).
        batch = input_context.get_per_replica_batch_size(global_batch)  # the global batch on CPU
        return (tf.data.Dataset.from_tensor_slices((x_train, y_train))
                .shuffle(len(x_train)).repeat().batch(batch).prefetch(2))

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    with strategy.scope():  # variables (model, optimizer, metrics) are created on the ps tasks
        model = tf.keras.Sequential([
            tf.keras.layers.Input(shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(16, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),  # logits
        ])
        optimizer = tf.keras.optimizers.Adam(args.learning_rate)
        optimizer.build(model.trainable_variables)  # slot variables now, not inside a worker's step
        # The loop's own step counter: steps finished, advanced here after each epoch's join (not
        # by the workers, whose steps may run twice when a worker is lost and they are retried).
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        train_loss = tf.keras.metrics.Mean("train_loss")
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy("train_accuracy")
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

    def replica_fn(batch):
        images, labels = batch
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            # Average over the global batch (not the per-replica one): the gradients of all
            # replicas of a worker are summed.
            loss = tf.nn.compute_average_loss(loss_fn(labels, logits), global_batch_size=global_batch)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_loss.update_state(loss)
        train_accuracy.update_state(labels, logits)
        return loss

    @tf.function
    def train_steps(iterator, steps):
        # Several steps per scheduled function: one round trip to the worker for all of them.
        # `steps` is a tensor argument: one traced function for every count.
        loss = tf.constant(0.0)
        for _ in tf.range(steps):
            loss = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    # How many steps each scheduled function runs: --steps-per-call, else dtf measures the round
    # trip to a worker and a step's time on the first functions, and chooses (it says so).
    packing = dtf.packing(args.steps_per_call)

    # Checkpoints are written here, on the coordinator: options=dtf.checkpoint_options() (without
    # them, each ps would write its variables to its own disk). dtf.checkpoint_dir() is the same
    # directory in every attempt of a `dtf train` run: a resumed run continues from it.
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = tf.train.CheckpointManager(checkpoint, str(dtf.checkpoint_dir()), max_to_keep=3)
    total = args.epochs * args.steps_per_epoch
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint, options=dtf.checkpoint_options()).assert_consumed()
        print(f"resumed at step {int(step.numpy())}/{total} from {manager.latest_checkpoint} "
              f"(attempt {dtf.attempt()})", flush=True)
    first_step = int(step.numpy())

    history = []
    for epoch in range(first_step // args.steps_per_epoch + 1, args.epochs + 1):
        train_loss.reset_state()
        train_accuracy.reset_state()
        for n in packing.closures(args.steps_per_epoch):  # counts summing to steps_per_epoch
            # Non-blocking: queues the function; a free worker runs it with ITS iterator.
            coordinator.schedule(train_steps, args=(per_worker_iterator, tf.constant(n, tf.int64)))
        coordinator.join()  # wait until every scheduled function has run
        step.assign_add(args.steps_per_epoch)
        manager.save(checkpoint_number=epoch, options=dtf.checkpoint_options())
        loss, accuracy = float(train_loss.result()), float(train_accuracy.result())
        history.append({"epoch": epoch, "loss": loss, "accuracy": accuracy})
        print(f"epoch {epoch}/{args.epochs} done: step {int(step.numpy())}, loss {loss:.4f}, "
              f"accuracy {accuracy:.4f} (attempt {dtf.attempt()})", flush=True)

    if not history:
        print(f"custom_loop: nothing to do: the checkpoint in {dtf.checkpoint_dir()} is at step "
              f"{first_step}/{total} (delete it, or use another --output, to train again)")
        return
    summary = {
        "example": "custom_loop",
        "global_batch": global_batch,
        "epochs": args.epochs,
        "steps": int(step.numpy()),  # the loop's own counter: exactly epochs * steps_per_epoch
        "optimizer_steps": int(optimizer.iterations.numpy()),  # more if a lost worker's steps ran twice
        "resumed_at_step": first_step,
        "attempt": dtf.attempt(),
        "first_loss": history[0]["loss"],  # mean training loss of the first epoch
        "final_loss": history[-1]["loss"],  # ... and of the last epoch
        "first_accuracy": history[0]["accuracy"],
        "final_accuracy": history[-1]["accuracy"],
        "history": history,
        "checkpoint": manager.latest_checkpoint,
        "steps_per_call": packing.chosen,
        "wall_seconds": round(time.monotonic() - start, 1),
    }
    summary_path = dtf.output_dir() / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"custom_loop: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> "
          f"{summary['final_loss']:.3f}, train accuracy {summary['final_accuracy']:.3f}; "
          f"wrote {summary_path}")


if __name__ == "__main__":
    main()
