"""A common shape of a TensorFlow program on a Slurm cluster: MultiWorkerMirroredStrategy with
SlurmClusterResolver, every parameter read from Slurm, a short `fit` with BackupAndRestore. Run
unchanged under `dtf train --collective` on a Slurm cluster, as under the user's own `srun`.

CPU nodes: `gpus_per_node=1, auto_set_gpu=False` (the default runs nvidia-smi, and 0 divides by
zero: tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py). Writes summary.json (chief) in its working directory.
"""

import json

import numpy as np
import tensorflow as tf

resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=1, auto_set_gpu=False)
strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
workers = strategy.num_replicas_in_sync
print(f"{resolver.task_type}:{resolver.task_id} of {workers}: {resolver.cluster_spec().as_dict()}", flush=True)

rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) > 0).astype("float32")
data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=0).repeat().batch(64 * workers)

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy")
history = model.fit(data, epochs=3, steps_per_epoch=20, verbose=2,
                    callbacks=[tf.keras.callbacks.BackupAndRestore(backup_dir="backup")])
if resolver.task_id == 0:
    with open("summary.json", "w") as f:
        json.dump({"workers": workers, "loss": history.history["loss"],
                   "cluster": resolver.cluster_spec().as_dict()}, f)
print(f"{resolver.task_type}:{resolver.task_id} done", flush=True)
