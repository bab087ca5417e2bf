"""dtf's hook against TensorFlow's own SlurmClusterResolver (no GPU and no Slurm needed: the
step's Slurm variables are given): with a copy's CUDA_VISIBLE_DEVICES holding dtf's share of its
node's 4 GPUs, the resolver's auto_set_gpu keeps that share with the hook. (Without it, checked
by hand: the resolver counts the share's 2 GPUs as the node's, and sets GPU 1, worker 0's.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.tf

PROGRAM = """
import os
from dtf.program import hooks
hooks.install(["collective"])
import tensorflow as tf
r = tf.distribute.cluster_resolver.SlurmClusterResolver()
r.cluster_spec()  # sets task_type, task_id (and CUDA_VISIBLE_DEVICES: auto_set_gpu)
print(r.task_type, r.task_id, os.environ["CUDA_VISIBLE_DEVICES"])
"""


def test_slurm_cluster_resolver_keeps_dtfs_gpu_share() -> None:
    # worker 1 of 2 on a node of 4 GPUs: dtf's share is 2,3 (dtf.cluster.gpus.shares)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3", "DTF_NODE_GPUS": "4", "SLURM_PROCID": "1",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["worker", "1", "2,3"]
