"""Whether tasks reach each other and this machine reaches them: the mesh check of `up` (from each
host, the other hosts' tasks it connects to in training: `others`), and the tasks this machine
cannot reach (`dtf train`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.hostops.launcher import ask
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hosts.base import HostError
from dtf.hosts.netutil import port_open, probe_all
from dtf.providers import route
from dtf_server.protocol import ReachReply

PROBE_TIMEOUT = 3.0  # seconds a task's port gets to accept a connection from this machine
MESH_TIMEOUT = 5.0  # seconds each host gives a connection to another host's task


def others(plan: Plan, hp: HostPlan) -> dict[str, TaskPlan]:
    """The other hosts' tasks that the host's tasks connect to in training, by the address they
    reach them at: the mesh check's targets from that host.

    With ps tasks (ParameterServerStrategy), a worker sees only the ps tasks and the chief, a ps
    only the workers and the chief: the device filters the strategy gives every task
    (parameter_server_strategy_v2's _connect_to_cluster). A host's workers need the other hosts'
    ps, its ps their workers; no worker ever connects to another worker, nor a ps to a ps. A
    100-host cluster of one ps is 198 connections to check so, not 9,900: the check grows with
    the hosts, not with their square. Without ps (a cluster for `train --collective`
    only: MultiWorkerMirroredStrategy's collectives), every worker reaches every other. `train
    --collective` on a cluster with ps (whose ps it does not use) names a worker that another
    cannot reach when the copies do not all join (collective.run's diagnosis).
    (The chief is this machine: Starter._reachable checks it reaches every task.)"""
    tasks = plan.tasks()
    if any(t.job == "ps" for t in tasks):
        mine = {t.job for t in hp.tasks}
        wanted = {"ps"} if mine == {"worker"} else {"worker"} if mine == {"ps"} else {"ps", "worker"}
    else:
        wanted = {"worker"}
    return {t.address: t for t in tasks if t.host != hp.name and t.job in wanted}


def check_mesh(ops: HostOps, hosts: Sequence[HostPlan] | None = None,
               timeout: float = MESH_TIMEOUT) -> dict[str, Outcome[None]]:
    """From each host (or those in `hosts`), open a connection to every task of the other hosts
    that its tasks connect to in training (`others`): each reaches them at their planned address,
    or training hangs: the coordinator gives every task its own cluster spec
    (tensorflow/python/eager/remote.py: connect_to_cluster).
    HostError names the pairs. (`up` asks it of the hosts whose start did not check it itself:
    `Starter(mesh=True)`.)"""
    def one(hp: HostPlan) -> None:
        targets = others(ops.plan, hp)
        if not targets:
            return
        ops.step(hp, "checking it reaches the other hosts' tasks")
        with ops.runner(hp) as t:
            reply = ask(t, hp, ReachReply, hp.reach_argv(list(targets), timeout),
                        "checking the other hosts' TF ports", timeout + 30)
        if reply.unreachable:
            raise HostError("; ".join(f"cannot reach {targets[a].name} at {a} (on {targets[a].host}): {why}"
                                      for a, why in reply.unreachable.items()))

    return ops.each_host(one, hosts, at_once=ops.at_once())


def unreachable(ops: HostOps, network: str, timeout: float, names: Collection[str] | None = None) -> list[TaskPlan]:
    """The tasks (all, or those named) this machine cannot open a connection to: directly, or
    (network ssh) through their host's SSH; every task of a host probed in parallel. Local
    hosts' tasks are probed directly."""
    def through(hp: HostPlan) -> list[TaskPlan]:
        tasks = hp.tasks_in(names)
        if not route.through_ssh(ops.plan, network, hp):
            return [task for task, ok in zip(tasks, probe_all(
                lambda task: port_open(task.addr_host, task.port, timeout), tasks)) if not ok]
        with ops.runner(hp) as t:
            return [task for task, ok in zip(tasks, probe_all(
                lambda task: t.reaches(task.address, timeout), tasks)) if not ok]

    hosts = [hp for hp in ops.plan.hosts if hp.tasks_in(names)]
    outcomes = ops.each_host(through, hosts)
    lost = {task.name for hp in hosts for task in (
        outcomes[hp.name].value if outcomes[hp.name].ok else hp.tasks_in(names))}
    return [task for task in ops.plan.tasks() if task.name in lost]
