"""A detached run as this machine asks its host (the launcher's `detached`), and what comes back
from there: its outputs (`fetch_outputs`), the moves its coordinator made (`adopt`), its end in the
record (`ended_record`); `settle`, before another run or `dtf down`."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from pathlib import Path

from dtf.cluster import state
from dtf.cluster.plan import HostPlan, Plan
from dtf.cluster.state import DetachedRun, Record
from dtf.errors import DtfError, HostFailure, UsageError
from dtf.hostops import launcher
from dtf.hostops.parallel import HostOps
from dtf.hosts.base import HostError
from dtf_server.protocol import DetachedLayout, DetachedReply, DetachedRequest, Layout, StopReply, StopRequest

ASK_TIMEOUT = 60.0  # seconds for one launcher command about the run
COLLECT_TIMEOUT = 600.0  # seconds its host gets to gather the outputs (links, or copies)

Say = Callable[[str], None]


def run_dir(hp: HostPlan) -> str:
    return DetachedLayout.dir(hp.root)


def detached_of(record: Record) -> DetachedRun:
    if record.detached is None:
        raise UsageError(f"cluster {record.cluster!r} has no detached run (`dtf train --detach PROGRAM` starts one)")
    return record.detached


def host_of(plan: Plan, d: DetachedRun) -> HostPlan:
    hp = next((h for h in (*plan.hosts, *plan.retired) if h.name == d.host), None)
    if hp is None:
        raise UsageError(f"the detached run's host {d.host} is no longer in cluster {plan.cluster!r}'s record")
    return hp


def ask_state(ops: HostOps, hp: HostPlan, collect: bool = False, fresh: bool = False,
              timeout: float = ASK_TIMEOUT) -> DetachedReply:
    with ops.runner(hp) as t:
        return launcher.ask(t, hp, DetachedReply, hp.launcher_argv(DetachedRequest(dir=hp.root, collect=collect,
                                                                                   fresh=fresh)),
                            "asking for the detached run", timeout)


def fetch_outputs(ops: HostOps, hp: HostPlan, d: DetachedRun) -> tuple[int, DetachedReply]:
    """What the program wrote, gathered on its host (`detached --collect`), into the laptop's
    directories it was started from: the files copied, and the run's state."""
    reply = ask_state(ops, hp, collect=True, timeout=COLLECT_TIMEOUT)
    if reply.state != "ended" or reply.run_id != d.run_id:
        return 0, reply
    back = posixpath.join(DetachedLayout.dir(hp.root), DetachedLayout.BACK)
    count = 0
    with ops.runner(hp) as t:
        count += t.fetch_tree(posixpath.join(back, DetachedLayout.WORK), Path(d.cwd))
        if d.output is not None:
            count += t.fetch_tree(posixpath.join(back, DetachedLayout.OUTPUT), Path(d.output))
    return count, reply


def adopt(plan: Plan, reply: DetachedReply) -> Plan:
    """The laptop's plan with the moves the coordinator made (tasks moved to a spare), as its
    reply places the tasks, and without the retired hosts it has cleaned."""
    if reply.placement is None:
        return plan
    for spare, names in reply.placement.items():
        if not names or plan.spare(spare) is None:
            continue
        was = next((hp.name for hp in plan.hosts if {t.name for t in hp.tasks} == set(names)), None)
        if was is not None:
            plan = plan.moved_to(was, spare)
    gone = [hp.name for hp in plan.retired if hp.name not in reply.retired]
    return plan.without_retired(gone) if gone else plan


def ended_record(record: Record, d: DetachedRun, reply: DetachedReply, fetched: bool) -> Record:
    """The record, as it is now on disk, with the run's end (and the coordinator's moves)."""
    done = d.replace(ended=True, exit_code=reply.exit_code, reason=reply.reason, fetched=fetched)
    with state.locked():
        now = state.load(record.cluster)
        now = now.replace(plan=adopt(now.plan, reply), recovered={**now.recovered, **reply.recovered},
                          detached=done)
        state.save(now)
    return now


def settle(record: Record, ops: HostOps, say: Say, *, stop_run: bool = False, grace: float = 10.0) -> Record:
    """Before another detached run or `dtf down`: a detached run that still runs is refused (or
    stopped, with `stop_run`); one that ended brings back its outputs if they are not here yet.
    A host that does not answer is said, with where the outputs stay."""
    d = detached_of(record)
    if d.ended and d.fetched:
        return record
    hp = host_of(record.plan, d)
    try:
        reply = ask_state(ops, hp)
    except (HostError, DtfError) as e:
        say(f"the detached run's host {d.host} does not answer ({e}): its outputs, if any, stay there in "
            f"{DetachedLayout.dir(hp.root)}")
        return record
    if reply.run_id != d.run_id or reply.state == "none":
        return record  # its files are gone (a lapsed lease, another dtf): nothing to bring back
    if reply.state == "running":
        if not stop_run:
            raise UsageError(f"cluster {record.cluster!r}: a detached run ({d.program}) still runs on {d.host}: "
                             f"`dtf down --stop-run` stops it (its outputs come here first); `dtf attach` follows it")
        say(f"stopping the detached run on {d.host} (--stop-run)")
        with ops.runner(hp) as t:
            launcher.ask(t, hp, StopReply, hp.bare_launcher_argv(StopRequest(dir=hp.root, grace=grace,
                                                                             task=[Layout.CHIEF])),
                         "stopping the detached run", grace + 30)
    try:
        count, reply = fetch_outputs(ops, hp, d)
    except (HostError, OSError) as e:
        raise HostFailure("fetching the detached run's outputs", {
            d.host: f"{e} (they stay in {DetachedLayout.dir(hp.root)} there; `dtf attach` fetches them)"})
    where = d.cwd + (f" and {d.output}" if d.output else "")
    say(f"the detached run {d.program} {reply.reason or 'ended'}: {count} file(s) of its outputs fetched into {where}")
    return ended_record(record, d, reply, fetched=True)


def refuse_if_running(record: Record, ops: HostOps) -> None:
    """A coordinator here while the detached run's coordinator runs there would be two on one
    cluster: refused in one line. A host that does not answer is not asked twice: its run, if it
    still runs, is the user's to stop (`dtf down --stop-run`)."""
    d = record.detached
    if d is None or d.ended:
        return
    try:
        reply = ask_state(ops, host_of(record.plan, d))
    except (HostError, DtfError):
        return
    if reply.state == "running" and reply.run_id == d.run_id:
        raise UsageError(f"cluster {record.cluster!r}: a detached run ({d.program}) still runs on {d.host}: "
                         f"`dtf attach` follows it; `dtf down --stop-run` stops it")
