"""Collective mode (`dtf train --collective`): tell dtf when this program copy has joined its cluster.

MultiWorkerMirroredStrategy waits for missing workers forever. dtf gives the copies a start
deadline, and needs an explicit signal that a copy has joined: right after a
MultiWorkerMirroredStrategy is made (by `dtf.strategy()` or by the program itself), one tiny
all-reduce across every worker (the same barrier TensorFlow's own health check uses before it
starts: a worker whose port the others cannot reach never passes it), then the file
$DTF_JOINED is written; the host's `follow` turns it into an event for the laptop.

On Slurm with GPUs ($DTF_NODE_GPUS), SlurmClusterResolver counts the node's GPUs, not the copy's
share in CUDA_VISIBLE_DEVICES (`count_node_gpus`): its split of them is then dtf's.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from dtf.cluster.gpus import NODE_GPUS_ENV
from dtf.program.hooks import on_import

JOINED_ENV = "DTF_JOINED"
MODULE = "tensorflow.python.distribute.collective_all_reduce_strategy"


SLURM_RESOLVER = "tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver"


def install() -> None:
    path = os.environ.get(JOINED_ENV)
    if path:
        on_import(MODULE, lambda module: _patch(module, path))
    node_gpus = os.environ.get(NODE_GPUS_ENV, "")
    if node_gpus.isdigit():
        on_import(SLURM_RESOLVER, lambda module: count_node_gpus(module, int(node_gpus)))


def count_node_gpus(module: ModuleType, n: int) -> None:
    """On Slurm, a copy's CUDA_VISIBLE_DEVICES holds its share of the node's GPUs (dtf.cluster.gpus),
    while SlurmClusterResolver counts the NODE's GPUs in it (its `get_num_gpus`, when the program
    gives no gpus_per_node) to split them among the node's tasks: it counts the node's `n`, so
    that its split (and the CUDA_VISIBLE_DEVICES its auto_set_gpu sets) is dtf's share."""
    module.get_num_gpus = lambda: n  # type: ignore[attr-defined]


def _patch(module: ModuleType, path: str) -> None:
    cls = module.CollectiveAllReduceStrategy
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        joined(self, path)

    cls.__init__ = __init__


def joined(strategy: Any, path: str) -> None:
    """Pass a barrier with every worker, then say so (once per program copy)."""
    if os.path.exists(path):
        return
    if strategy.extended._num_workers > 1:
        import tensorflow as tf

        strategy.reduce("SUM", strategy.run(lambda: tf.ones([])), axis=None)
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n")
