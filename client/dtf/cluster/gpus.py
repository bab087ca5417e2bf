"""Which GPUs each task of a host sees: the inventory's `gpus` (a count, or device ids) split
among the host's worker tasks, one contiguous share each, by `CUDA_VISIBLE_DEVICES`.

With as many GPUs as workers or more, the shares are disjoint (the first workers get one more
when they do not divide evenly); with fewer GPUs than workers, workers share them round-robin
(memory growth lets them). A ps sees none: its variables live on its CPU. Memory growth is on
(`TF_FORCE_GPU_ALLOW_GROWTH`): TensorFlow would otherwise take all of a GPU's memory at once.
A host without `gpus` gets no variable at all (TensorFlow's own defaults). The same assignment
serves ParameterServerStrategy workers (their servers) and collective mode's program copies, in
which a MirroredStrategy uses the copy's GPUs.

On Slurm (`gpus_per_node`, or a `--gres` of GPUs) the node's GPUs are numbered 0..N-1, as Slurm
numbers a job's GPUs in its steps where their devices are constrained (ConstrainDevices=yes, the
usual setup of GPU sites). A program that builds SlurmClusterResolver (its default auto_set_gpu)
sets its own CUDA_VISIBLE_DEVICES: block k of N // W ids for its k-th task on the node (W tasks a
node). That is dtf's share whenever W divides N, once the resolver counts the node's N GPUs and
not the copy's share (NODE_GPUS_ENV, read by dtf.program.hooks.collective); otherwise the two
differ, and the Slurm provider says so (dtf.providers.slurm.commands.gpu_note).
"""

from __future__ import annotations

from collections.abc import Sequence


def shares(gpus: Sequence[int], workers: int) -> list[list[int]]:
    """Each of `workers` worker tasks' GPU ids, in task order."""
    if workers <= 0:
        return []
    if not gpus:
        return [[] for _ in range(workers)]
    if len(gpus) < workers:
        return [[gpus[i % len(gpus)]] for i in range(workers)]
    base, extra = divmod(len(gpus), workers)
    out, start = [], 0
    for i in range(workers):
        size = base + (1 if i < extra else 0)
        out.append(list(gpus[start:start + size]))
        start += size
    return out


def task_env(gpus: Sequence[int] | None, job: str, position: int, workers: int) -> dict[str, str]:
    """The variables of one task: the `position`-th worker of its host (or a ps). `gpus` None:
    the host has no `gpus` key, and nothing is set."""
    if gpus is None:
        return {}
    visible = [] if job == "ps" else shares(gpus, workers)[position]
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in visible), "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


NODE_GPUS_ENV = "DTF_NODE_GPUS"  # a copy's node's GPU count (Slurm), for SlurmClusterResolver


def env_prefix(variables: dict[str, str]) -> list[str]:
    """`env K=V ...` before a command (nothing when there are no variables)."""
    return ["env", *(f"{k}={v}" for k, v in variables.items())] if variables else []
