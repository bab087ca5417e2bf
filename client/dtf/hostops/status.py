"""What the hosts say about a plan's tasks: `status` asks every host, and `task_states` turns the
replies into one state per task (the one place that does: `TaskStatus.state` decides);
`cluster_status` is `dtf status` (a Slurm cluster's job first), `tail_log` is `dtf logs`."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass

from dtf.cluster import state
from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.cluster.state import Record
from dtf.errors import ClusterDown, HostFailure, UsageError
from dtf.hostops.launcher import RENEW_TIMEOUT, LauncherMissing, ask, root_exists
from dtf.hostops.parallel import HostOps, Outcome
from dtf.providers.provider import AllocationReport
from dtf_server.protocol import RenewReply, StatusReply, TaskStatus

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
    with ops.runner(hp) as t:
        try:
            return ask(t, hp, StatusReply, hp.status_argv(), "status", 30,
                       upload_if=lambda: root_exists(t, hp))
        except LauncherMissing:
            # dtf's files are gone: the lease lapsed and the tasks cleaned up after
            # themselves, or the host was wiped. Every task is dead.
            gone = TaskStatus.dead(FILES_GONE.format(root=hp.root))
            return StatusReply(tasks={task.name: gone for task in hp.tasks}, lease=None)


def status(ops: HostOps) -> dict[str, Outcome[StatusReply]]:
    return ops.each_host(lambda hp: status_host(ops, hp), at_once=ops.at_once())


def states(ops: HostOps) -> list[TaskState]:
    """Every task's state, as its host reports it now."""
    return task_states(ops.plan, status(ops))


@dataclass
class StatusResult:
    """What `dtf status` found: every task's state, and the hosts' allocation where a scheduler
    lends them (`report`; while it no longer runs, the hosts were not asked)."""

    record: Record
    states: list[TaskState]
    report: AllocationReport | None = None

    @property
    def ended(self) -> str | None:
        return self.report.ended if self.report is not None else None

    def ended_error(self) -> ClusterDown:
        assert self.report is not None and self.report.ended is not None
        return ClusterDown(f"cluster {self.record.cluster!r}: {self.report.ended}{self.report.forget}")


def cluster_status(name: str | None, *, connect_timeout: float) -> StatusResult:
    """`dtf status`: the hosts' allocation first, where a scheduler lends them (its hosts are
    asked only while it runs), then every host, asked now."""
    with state.locked():
        record = state.load(state.resolve_name(name))
    ops = HostOps(record.plan, connect_timeout=connect_timeout)
    report = ops.provider.report(record, "dtf status")
    if report is not None and report.ended is not None:
        return StatusResult(record, [], report)
    return StatusResult(record, states(ops), report)


def tail_log(name: str | None, task: str, *, lines: int, follow: bool, everything: bool = False) -> int:
    """`dtf logs`: the task's log, from its host (a Slurm node's through a job step), copied to
    this process's stdout as it comes (CommandRunner.stream): its last `lines` lines, without
    TensorFlow's own unless `everything` (the launcher's `log` picks them on the host:
    dtf_server.tflog); the command's exit code. Reading a log is a use of the cluster: the lease
    is renewed first (which also puts this dtf's launcher there, where it is missing)."""
    from dtf.hosts.base import HostError

    with state.locked():
        plan = state.load(state.resolve_name(name)).plan
    t = plan.task(task)
    if t is None:
        raise UsageError(f"cluster {plan.cluster!r} has no task {task!r} "
                         f"(tasks: {', '.join(x.name for x in plan.tasks())})")
    hp = plan.host_of(t)
    ended_by: list[int] = []
    try:
        # SIGTERM and SIGHUP end it as Ctrl-C does: the stream's ssh (and with it the command on
        # the host) is stopped, not left running after dtf.
        with HostOps(plan).runner(hp) as conn, _signals_interrupt(ended_by):
            try:
                ask(conn, hp, RenewReply, hp.renew_argv(), "renew", RENEW_TIMEOUT,
                    upload_if=lambda: root_exists(conn, hp))
            except LauncherMissing:
                raise HostFailure("dtf logs", {hp.name: f"dtf's files are gone from {hp.root} "
                                                        f"(taken down, or its lease lapsed)"}) from None
            code = conn.stream(hp.log_argv(t.name, lines, follow, everything))
    except HostError as e:
        raise HostFailure("dtf logs", {hp.name: str(e)})
    return 128 + ended_by[0] if ended_by else code


@contextlib.contextmanager
def _signals_interrupt(received: list[int]) -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise KeyboardInterrupt (the signal noted in `received`)."""
    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
