"""dtf: train TensorFlow models on a cluster of SSH hosts, driven from your laptop.

This package is both the `dtf` command (dtf.cli) and a small helper API for training programs:

    import dtf
    strategy = dtf.strategy()          # ParameterServerStrategy on the cluster of `dtf train`
    coordinator = dtf.coordinator()    # its ClusterCoordinator
    dtf.output_dir("logs")             # a directory on the laptop for checkpoints, logs, models
    dtf.checkpoint_dir()               # where to resume from: the same for every attempt of a run
    dtf.BackupAndRestore()             # tf-keras BackupAndRestore, writing on the laptop
    dtf.attempt()                      # 1, or 2, 3... when `dtf train` ran the program again
    dtf.checkpoint_options()           # pass to ModelCheckpoint / CheckpointManager.save / save_weights
    dtf.save_options()                 # pass to model.save / tf.saved_model.save
    dtf.synced("data")                 # where `dtf sync data` put it, as the workers see it
    dtf.packing()                      # custom loops: how many steps each scheduled closure runs
    dtf.collective_mode()              # True in a copy of a `dtf train --collective` program
    dtf.connect()                      # a notebook or any process: the coordinator of `dtf up`'s cluster

Under `dtf train --collective` the program runs on the hosts, one copy per worker:
`dtf.strategy()` is then a MultiWorkerMirroredStrategy, `dtf.output_dir()` the copy's output
directory (the chief's comes back to the laptop) and the options above are plain ones.

Why the options: under ParameterServerStrategy the variables live on the ps, and TensorFlow places
a checkpoint's save ops next to them, so without these options each ps writes its shard to ITS OWN
disk (a relative path is even relative to the server's working directory). The options put all
file I/O on the coordinator, so checkpoints and saved models land on the laptop. Under `dtf train`
that is the default for every save and restore once the strategy is made (dtf.program.hooks.saving: stock
ModelCheckpoint, BackupAndRestore, model.save, save_weights/load_weights, tf.train.Checkpoint), so
the helpers matter for programs run elsewhere; an I/O device the program names itself wins.

Under `dtf train` dtf also guards against what would fail late and unreadably (dtf.program.hooks.guards:
an in-graph dataset over 2 GB, Keras 3, call-backs to the coordinator in ssh mode, exact evaluation of
fewer batches than shards), refuses training that would run on the laptop rather than the cluster
(dtf.program.hooks.oncluster: exit code 9), and keeps
TensorFlow's C++ chatter off the program's stderr unless `dtf train --verbose` (dtf.program.noise).

Resuming: a lost ps loses its variables, so `dtf train` runs the program again (after the ps is
back) and the program must continue from its last checkpoint: `dtf.checkpoint_dir()` is the same
directory in every attempt (under `dtf train --output`), `dtf.BackupAndRestore()` does it for
`model.fit`, and a custom loop restores a `tf.train.CheckpointManager` there (examples/).

Under `dtf train` the cluster comes from TF_CONFIG (chief = this program). Run plainly
(`python my_model.py`) the same calls start a small in-process cluster (1 ps, 2 workers), so the
program runs unchanged for local debugging.

Importing dtf does not import TensorFlow (the CLI must start fast); it only makes `tf.keras`
resolve to tf-keras, which `model.fit` under ParameterServerStrategy needs (Keras 3 has no
ParameterServerStrategy: keras-team/keras#18624), also after `import tensorflow` as long as nothing
used `tf.keras` yet (dtf.program.tfkeras); `strategy()` refuses a `tf.keras` already bound to Keras 3.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from dtf.program.packer import Packer

__all__ = [
    "COORDINATOR_DEVICE",
    "BackupAndRestore",
    "attempt",
    "checkpoint_dir",
    "checkpoint_options",
    "collective_mode",
    "connect",
    "coordinator",
    "local_cluster_spec",
    "num_workers",
    "output_dir",
    "packing",
    "save_options",
    "strategy",
    "synced",
    "under_dtf",
]

if "tensorflow" not in sys.modules:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    # Fail fast instead of retrying forever on a dead peer (recommended for every task).
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
else:  # tf.keras picks its Keras at its first use, not at TensorFlow's import (dtf.program.tfkeras)
    from dtf.program import tfkeras as _tfkeras

    _tfkeras.use_tf_keras()

_strategy: Any = None
_coordinator: Any = None
_resolver: Any = None
_local_servers: list[Any] = []  # keeps the in-process servers alive for the program's lifetime

LOCAL_WORKERS_ENV = "DTF_LOCAL_WORKERS"
LOCAL_PS_ENV = "DTF_LOCAL_PS"
OUTPUT_DIR_ENV = "DTF_OUTPUT_DIR"
COLLECTIVE_ENV = "DTF_COLLECTIVE"  # "1": a copy of a `dtf train --collective` program, on a host
SYNCED_ENV = "DTF_SYNCED"  # JSON {name: path on the workers}, set by `dtf train` (dtf.files.sync)
# ParameterServerStrategy names the program's own job "chief", both under `dtf train` (TF_CONFIG)
# and on the in-process cluster.
COORDINATOR_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"
"""The coordinator's device (this program's, on the laptop): the `experimental_io_device` of
`checkpoint_options()` and `save_options()`."""


def under_dtf() -> bool:
    """True when this program runs as the coordinator of a dtf cluster (`dtf train`)."""
    return bool(os.environ.get("TF_CONFIG")) and bool(os.environ.get("DTF_CLUSTER"))


def connect(cluster: str | None = None, **kwargs: Any) -> Any:
    """Make this process (a Jupyter kernel, IPython, a script) the coordinator of the cluster that
    `dtf up` started, as `dtf train` makes a program: the handle (a `Connection`) has `.strategy`,
    `.coordinator`, `.status()`, `.logs(task)` and `.close()`.

    ```python
    cluster = dtf.connect()          # the only cluster up; dtf.connect("name") picks one
    ```

    Called again, it returns the same handle. TensorFlow connects a process to one cluster, so
    another cluster is refused: restart the kernel to connect to it.

    Args:
        cluster: the cluster's name (the inventory's `cluster:`); None: the only one up.
        **kwargs: `output`: the output directory, as `dtf train --output`; `verbose`: keep
            TensorFlow's INFO and WARNING lines; `packing`: False as `dtf train --no-packing`;
            `ps_wait`: seconds a lost ps gets to serve again before the error says it did not;
            `connect_timeout`: seconds to reach a host.
    """
    from dtf.notebook.connection import connect as connect_

    return connect_(cluster, **kwargs)


def collective_mode() -> bool:
    """True when this program is one copy of a `dtf train --collective` run (on a host)."""
    return os.environ.get(COLLECTIVE_ENV) == "1"


def strategy(**kwargs: Any) -> Any:
    """The ParameterServerStrategy of this run, made once and cached; under `dtf train
    --collective`, the MultiWorkerMirroredStrategy of this copy (ring all-reduce, for CPUs).

    Keyword arguments (e.g. `variable_partitioner`) go to the strategy.
    """
    global _strategy, _resolver
    if _strategy is None:
        import tensorflow as tf

        if collective_mode():
            _resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            ring = tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING)
            _strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=_resolver, communication_options=kwargs.pop("communication_options", ring),
                **kwargs)
            return _strategy
        from dtf.program import tfkeras

        refused = tfkeras.refusal(tf)
        if refused is not None:
            raise SystemExit(f"dtf: error: {refused}")
        if os.environ.get("TF_CONFIG"):
            _resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        else:
            _resolver = _start_local_cluster(tf)
        _strategy = tf.distribute.ParameterServerStrategy(_resolver, **kwargs)
        from dtf.program.hooks import wrap

        wrap.adapt_fit()  # numpy arrays in fit, evaluate and predict, as --wrap has them
    return _strategy


def coordinator() -> Any:
    """The ClusterCoordinator of `strategy()`, made once and cached."""
    global _coordinator
    if collective_mode():
        raise RuntimeError("dtf.coordinator(): there is no coordinator under `dtf train --collective` "
                           "(MultiWorkerMirroredStrategy: every worker runs the program)")
    if _coordinator is None:
        import tensorflow as tf

        _coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy())
    return _coordinator


def num_workers() -> int:
    """How many worker tasks the cluster has."""
    strategy()
    spec = _resolver.cluster_spec().as_dict()
    return len(spec.get("worker", []))


def packing(steps_per_call: int | None = None) -> Packer:
    """Steps per closure for a custom loop: measured and chosen by dtf, or `steps_per_call`.

    ```python
    packing = dtf.packing(args.steps_per_call)     # None: dtf measures and chooses
    for n in packing.closures(steps_per_epoch):    # step counts summing to steps_per_epoch
        coordinator.schedule(train_steps, args=(iterator, tf.constant(n)))
    coordinator.join()
    ```

    Each closure costs a round trip to a worker. With no `steps_per_call`, the first closures
    are timed one at a time (the loop's own steps: nothing is wasted) to measure the round trip
    and a step's time; then each closure runs enough steps to keep the round trip under 5% of
    it, at most an epoch's share of one worker; dtf prints what it chose. The scheduled function
    takes the count as an argument (a tensor: a Python int would retrace it for every count).
    `dtf train --no-packing` makes it 1 where the program gives no value.
    """
    from dtf.program.packer import Packer

    if steps_per_call is None and os.environ.get("DTF_PACKING") == "off":
        steps_per_call = 1
    return Packer(workers=num_workers(), wait=coordinator().join, explicit=steps_per_call,
                  say=lambda message: print(f"dtf: {message}", file=sys.stderr, flush=True))


def output_dir(*parts: str) -> Path:
    """A directory on the laptop (created if needed) for checkpoints, TensorBoard logs and models.

    The run's output directory: `dtf train --output DIR` (`$DTF_OUTPUT_DIR`), else `./dtf-output`;
    `parts` name a directory below it (`dtf.output_dir("logs")`).
    """
    from pathlib import Path

    path = Path(os.environ.get(OUTPUT_DIR_ENV) or "dtf-output").joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def checkpoint_dir(*parts: str) -> Path:
    """The directory to checkpoint to and resume from: `output_dir("checkpoints", *parts)`.

    It is the same in every attempt of a `dtf train` run (and in a later `dtf train` with the
    same --output, which then resumes too: delete it, or pick another --output, to start over).
    """
    return output_dir("checkpoints", *parts)


def synced(name: str, *parts: str, local: str | os.PathLike[str] | None = None) -> str:
    """The path of what `dtf sync PATH --as NAME` (or the inventory's `sync:`) sent to the hosts,
    as the workers see it: for file ops inside a `dataset_fn` (TFRecordDataset, TextLineDataset,
    tf.io.gfile.glob in the graph), which run ON THE WORKERS. `parts` are joined below it.

    The path is relative to the servers' working directory, so it is the same on every host; it
    is not a path on this machine (Python's own `open()` here would not find it). Run plainly
    (`python my_model.py`, an in-process cluster) it is `local`, or else NAME in the current
    directory, if that exists.
    """
    import json
    import posixpath

    known = os.environ.get(SYNCED_ENV)
    if known is not None and under_dtf():
        paths: dict[str, str] = json.loads(known or "{}")
        if name not in paths:
            have = f" (synced: {', '.join(sorted(paths))})" if paths else ""
            raise LookupError(f"dtf.synced({name!r}): nothing named {name!r} was synced to cluster "
                              f"{os.environ.get('DTF_CLUSTER')!r}{have}; run `dtf sync PATH --as {name}`")
        return posixpath.join(paths[name], *parts)
    from pathlib import Path

    path = Path(local) if local is not None else Path(name)
    if not path.exists():
        raise LookupError(f"dtf.synced({name!r}): not under `dtf train`, and {str(path)!r} does not exist "
                          f"here: pass local=PATH (the data on this machine)")
    return str(path.joinpath(*parts))


def attempt() -> int:
    """Which run of the program this is: 1, then 2, 3... when `dtf train` runs it again after a
    lost ps (see --attempts)."""
    return int(os.environ.get("DTF_ATTEMPT") or 1)


def BackupAndRestore(backup_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:  # noqa: N802
    """tf-keras' `BackupAndRestore` callback, with its backup written and read on the laptop.

    The stock callback lets TensorFlow put its save and restore ops next to the variables, on
    the ps: the backup would land on the ps's disk (see checkpoint_options). This one passes
    `checkpoint_options()` to both. `backup_dir` defaults to `checkpoint_dir("backup")`; other
    arguments (`save_freq`, `delete_checkpoint`) go to the callback. Under ParameterServerStrategy
    the backup is taken at the end of each epoch.
    """
    import tensorflow as tf
    from tf_keras.src.distribute import worker_training_state

    base = tf.keras.callbacks.BackupAndRestore
    if collective_mode():  # every worker does its own I/O; dtf copies the chief's backup for a restart
        return base(str(backup_dir or checkpoint_dir("backup")), **kwargs)
    options = checkpoint_options()

    class CoordinatorState(worker_training_state.WorkerTrainingState):  # type: ignore[misc]
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            for manager in {id(m): m for m in (self.read_checkpoint_manager,
                                               self.write_checkpoint_manager)}.values():
                _io_on_coordinator(manager._checkpoint, options)

    class OnCoordinator(base):  # type: ignore[misc, valid-type]
        def on_train_begin(self, logs: Any = None) -> None:
            # The base class makes its training state (and restores it) right here: give it ours.
            real = worker_training_state.WorkerTrainingState
            worker_training_state.WorkerTrainingState = CoordinatorState
            try:
                super().on_train_begin(logs)
            finally:
                worker_training_state.WorkerTrainingState = real

    return OnCoordinator(str(backup_dir or checkpoint_dir("backup")), **kwargs)


def _io_on_coordinator(checkpoint: Any, coordinator_options: Any) -> None:
    """Make one tf.train.Checkpoint read and write through the coordinator's device."""
    import copy

    write, restore = checkpoint._write, checkpoint.restore

    def _write(file_prefix: Any, options: Any = None, **kw: Any) -> Any:
        # CheckpointManager passes options of its own (write callbacks): keep them, set the device.
        merged = copy.copy(options if options is not None else coordinator_options)
        merged.experimental_io_device = COORDINATOR_DEVICE
        return write(file_prefix, options=merged, **kw)

    def _restore(save_path: Any, options: Any = None) -> Any:
        return restore(save_path, options=options or coordinator_options)

    checkpoint._write = _write
    checkpoint.restore = _restore


@functools.cache
def checkpoint_options() -> Any:
    """tf.train.CheckpointOptions that write checkpoints here, on the coordinator (the laptop).

    For `ModelCheckpoint(..., save_weights_only=True, options=...)`, `model.save_weights(...,
    options=...)`, `CheckpointManager.save(options=...)` and `Checkpoint.write/restore`.
    Always the same object (TensorFlow traces its save function once per options object).
    """
    import tensorflow as tf

    if collective_mode():  # no coordinator: each worker writes where it runs
        return tf.train.CheckpointOptions()
    return tf.train.CheckpointOptions(experimental_io_device=COORDINATOR_DEVICE)


def save_options() -> Any:
    """tf.saved_model.SaveOptions that write a SavedModel here, on the coordinator (the laptop).

    For `model.save(path, options=...)`, `tf.saved_model.save(..., options=...)` and
    `ModelCheckpoint(..., save_weights_only=False, options=...)`.
    """
    import tensorflow as tf

    if collective_mode():
        return tf.saved_model.SaveOptions()
    return tf.saved_model.SaveOptions(experimental_io_device=COORDINATOR_DEVICE)


def local_cluster_spec(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """A cluster spec of free loopback ports (used for the in-process cluster)."""
    from dtf.hosts.netutil import listen_ports

    ports = listen_ports(num_workers + num_ps, "127.0.0.1")
    return {
        "worker": [f"localhost:{p}" for p in ports[:num_workers]],
        "ps": [f"localhost:{p}" for p in ports[num_workers:]],
    }


def _start_local_cluster(tf: Any) -> Any:
    """Start ps and worker servers in this process: PS semantics with no cluster at all."""
    spec = local_cluster_spec(
        int(os.environ.get(LOCAL_WORKERS_ENV, "2")), int(os.environ.get(LOCAL_PS_ENV, "1"))
    )
    cluster = tf.train.ClusterSpec(spec)
    config = tf.compat.v1.ConfigProto()
    # In-process workers share one thread pool: give each enough threads not to deadlock
    # (as TensorFlow's own in-process cluster helper does).
    config.inter_op_parallelism_threads = 4
    for job, addresses in spec.items():
        for index in range(len(addresses)):
            _local_servers.append(
                tf.distribute.Server(cluster, job_name=job, task_index=index, config=config, start=True)
            )
    print(
        f"dtf: no cluster (not under `dtf train`): started an in-process cluster with "
        f"{len(spec['ps'])} ps and {len(spec['worker'])} workers",
        file=sys.stderr,
    )
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
