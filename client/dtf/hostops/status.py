"""What the hosts say about a plan's tasks: `status` asks every host, and `task_states` turns the
replies into one state per task (the one place that does: `TaskStatus.state` decides)."""

from __future__ import annotations

from dataclasses import dataclass

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.hostops.launcher import LauncherMissing, ask, root_exists
from dtf.hostops.parallel import HostOps, Outcome
from dtf_server.protocol import StatusReply, TaskStatus

FILES_GONE = "dtf's files are gone from {root} (lease lapsed?)"


@dataclass(frozen=True)
class TaskState:
    """One task of a plan, as its host reported it: `state` is alive, restarting, failed, dead,
    or unknown (its host could not be asked: `reason` says why)."""

    task: TaskPlan
    state: str
    reason: str | None
    status: TaskStatus | None  # None when unknown


def task_states(plan: Plan, outcomes: dict[str, Outcome[StatusReply]]) -> list[TaskState]:
    """Every task's state, ps first (the one place that turns status replies into states)."""
    states = []
    for t in plan.tasks():
        o = outcomes[t.host]
        if not o.ok:
            states.append(TaskState(t, "unknown", o.reason, None))
            continue
        status = o.value.tasks.get(t.name) or TaskStatus.dead("not reported by its host")
        states.append(TaskState(t, status.state, status.reason, status))
    return states


def status_host(ops: HostOps, hp: HostPlan) -> StatusReply:
    ops.step(hp, "connecting")
    with ops.transport(hp) as t:
        try:
            return ask(t, hp, StatusReply, hp.status_argv(), "status", 30,
                       upload_if=lambda: root_exists(t, hp))
        except LauncherMissing:
            # dtf's files are gone: the lease lapsed and the tasks cleaned up after
            # themselves, or the host was wiped. Every task is dead.
            gone = TaskStatus.dead(FILES_GONE.format(root=hp.root))
            return StatusReply(tasks={task.name: gone for task in hp.tasks}, lease=None)


def status(ops: HostOps) -> dict[str, Outcome[StatusReply]]:
    return ops.each_host(lambda hp: status_host(ops, hp), turns=ops.turns())


def states(ops: HostOps) -> list[TaskState]:
    """Every task's state, as its host reports it now."""
    return task_states(ops.plan, status(ops))
