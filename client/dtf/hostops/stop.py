"""Stopping tasks and removing dtf's files from the hosts: `dtf down` (with `--purge`, the hosts'
caches too), the rollback of a failed `up`, and the partial stops of a repair and of collective mode."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dtf.cluster.plan import HostPlan
from dtf.hostops.launcher import ask
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hosts.base import HostError
from dtf.hosts.programs import script
from dtf_server.protocol import CleanReply, Defaults, PurgeReply, StopReply, TaskStopped

STOP_GRACE = Defaults.STOP_GRACE


@dataclass(frozen=True)
class HostStopped:
    stopped: dict[str, TaskStopped]
    removed: list[str] = field(default_factory=list)
    purged: PurgeReply | None = None  # `down --purge`: WORKDIR/.cache removed (or why not)


def stop_host(ops: HostOps, hp: HostPlan, keep_logs: bool = False, grace: float = STOP_GRACE,
              only: Collection[str] | None = None, purge: bool = False) -> HostStopped:
    """Stop the host's tasks and remove dtf's files; with `only`, stop just those tasks; with
    `purge`, remove WORKDIR/.cache too (managed environments, wheels, synced trees)."""
    ops.step(hp, "connecting")
    with ops.runner(hp) as t:
        ops.step(hp, "stopping servers")
        one_call = only is None and not purge  # stop and clean up in one round trip
        stopped = ask(t, hp, StopReply, hp.stop_argv(grace, only, clean=one_call, keep_logs=keep_logs),
                      "stopping servers", grace + 30)
        left = [n for n, s in stopped.tasks.items() if not s.gone]
        if left:
            raise HostError(f"still running after KILL: {', '.join(left)}")
        if only is not None:
            return HostStopped(stopped.tasks)
        if stopped.cleaned is not None:
            return HostStopped(stopped.tasks, stopped.cleaned.removed)
        purged = None
        if purge:  # before `clean`, which removes the launcher
            ops.step(hp, f"removing {hp.spec.workdir}/.cache")
            argv = hp.purge_argv()
            purged = ask(t, hp, PurgeReply, argv, "purging the cache", 300)
        ops.step(hp, "removing files")
        cleaned = ask(t, hp, CleanReply, hp.clean_argv(keep_logs), "cleaning up", 30)
    return HostStopped(stopped.tasks, cleaned.removed, purged)


def down(ops: HostOps, keep_logs: bool = False, grace: float = STOP_GRACE,
         hosts: Sequence[HostPlan] | None = None, purge: bool = False) -> dict[str, Outcome[HostStopped]]:
    return ops.each_host(lambda hp: stop_host(ops, hp, keep_logs, grace, purge=purge), hosts, at_once=ops.at_once())


def clean_retired(ops: HostOps) -> tuple[list[str], dict[str, str]]:
    """Stop the old tasks of the plan's retired hosts (their tasks moved to a spare) and remove
    dtf's files there: the hosts cleaned, and those that could not be (host -> why)."""
    done = down(ops, hosts=ops.plan.retired)
    return [h for h, o in done.items() if o.ok], {h: o.reason for h, o in done.items() if not o.ok}


def clean_spares(ops: HostOps) -> dict[str, str]:
    """Remove dtf's files from the plan's spares that hold any (a detached run's key lets its
    coordinator in there: dtf_server.sshkeys); a spare with none is only looked at. Host -> why,
    for those that could not be cleaned."""
    from dtf.hostops.launcher import LauncherMissing, root_exists

    def clean(hp: HostPlan) -> None:
        with ops.runner(hp) as t:
            try:
                ask(t, hp, CleanReply, hp.clean_argv(False), "cleaning up", 30, upload_if=lambda: root_exists(t, hp))
            except LauncherMissing:
                return  # nothing of dtf's there

    outcomes = ops.each_host(clean, ops.plan.spares, at_once=ops.at_once())
    return {h: o.reason for h, o in outcomes.items() if not o.ok}


def remove_launcher(ops: HostOps, hosts: Sequence[HostPlan]) -> dict[str, Outcome[CleanReply]]:
    """Undo an upload that no start followed: remove dtf's files unless tasks (another
    dtf's) run there."""
    def clean(hp: HostPlan) -> CleanReply:
        with ops.runner(hp) as t:
            python = hp.base_python or hp.python
            if t.run([python, "-c", ""], timeout=30).exit_code in (126, 127):
                # The host's python cannot run (the check failed for that): nothing of dtf's runs
                # there, and the launcher, which needs it, is all the upload left.
                t.run(["sh", "-c", script("remove_launcher.sh"), "sh", hp.launcher, hp.root], timeout=30)
                return CleanReply(removed=[hp.launcher])
            return ask(t, hp, CleanReply, hp.clean_argv(False, if_unused=True), "cleaning up", 30)

    return ops.each_host(clean, hosts, at_once=ops.at_once())


def stop_tasks(ops: HostOps, only: dict[str, set[str]], grace: float = STOP_GRACE) -> dict[str, Outcome[HostStopped]]:
    """Stop the tasks named per host (a partial rollback); leave the rest and the files."""
    return ops.each_host(lambda hp: stop_host(ops, hp, grace=grace, only=only[hp.name]),
                         ops.hosts_in(only), at_once=ops.at_once())
