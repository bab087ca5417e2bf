"""The lifecycle of a cluster: start (with its rollback), repair, teardown, and the local record.

`cli.py` parses arguments, calls one function here and prints what it returns; this module decides
what happens to the hosts and to the record. Nothing here prints: host progress goes through a
`ProgressView` the caller passes (dtf.hostops.parallel) (the CLI's live table), so these functions run as well under
tests.

The rule that matters most: whatever `dtf up` started is stopped again unless the whole `up`
succeeded. The rollback runs in a `finally`, and while hosts are being started or rolled back,
Ctrl-C does not raise (which could land anywhere, a rollback included): it only cancels the
start, whose threads stop at their next bounded step, and the rollback then runs to its end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from dtf.cluster import state
from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import Inventory
from dtf.cluster.plan import DEFAULT_TTL, Plan, differences, make_plan
from dtf.cluster.state import Record
from dtf.errors import ClusterChanged, HostFailure, InventoryError, NoCluster, Problem, UsageError
from dtf.files import sync
from dtf.hostops import lease, reach, status, stop, syncing
from dtf.hostops.parallel import HostOps, Outcome, ProgressView, failures, no_view, require_all
from dtf.hostops.repair import check_spares, restarted_note
from dtf.hostops.start import HostStarted, Starter
from dtf.hostops.stop import STOP_GRACE, HostStopped
from dtf.hosts.connections import check_ssh_config, resolver
from dtf.providers import choose as providers
from dtf.providers import route

SERVER_ENV = "DTF_SERVER"  # what serves each task: `tensorflow` (default), or `fake[:options]` for tests


def load_plan(inv: Inventory, ttl: float | None = None, server: str = "tensorflow",
              network: str | None = None, allocation: Allocation | None = None) -> Plan:
    """The plan of an inventory (bad input: InventoryError with file:line:col); one whose hosts
    come with an allocation (`allocated`) with its hosts."""
    if allocation is not None:
        inv = inv.with_nodes(allocation.nodes)
    try:
        plan = make_plan(inv, resolve=resolver(inv.ssh_config, inv.hosts), local_python=sys.executable,
                         ttl=DEFAULT_TTL if ttl is None else ttl, server=server, network=network,
                         allocation=allocation)
    except ValueError as e:  # only `server` can be wrong: the inventory was checked
        raise UsageError(f"{SERVER_ENV}: {e}")
    missing = [Problem(inv.path, item.line, item.column, f"sync[{i}]", f"{item.path}: no such file or directory")
               for i, item in enumerate(plan.sync) if not Path(item.path).exists()]
    if missing:
        raise InventoryError(missing)
    return plan


# -- up ---------------------------------------------------------------------------------------
@dataclass
class UpResult:
    """What `dtf up` did: started the cluster, restarted some of its tasks, or nothing."""

    record: Record
    started: bool = False  # the whole cluster was started
    outcomes: dict[str, Outcome[HostStarted]] = field(default_factory=dict)  # of the hosts started on
    seconds: float = 0.0
    restarted: list[tuple[str, str]] = field(default_factory=list)  # (task, its state before)
    serving: int = 0  # tasks that were serving and were left alone
    new_ttl: float | None = None  # the lease's new idle timeout, when `up` changed it
    synced: list[sync.Report] = field(default_factory=list)  # the inventory's `sync:`, sent or found
    # Hosts whose tasks moved to a spare and whose old tasks could not be stopped (host -> why).
    retired: dict[str, str] = field(default_factory=dict)


def up(plan: Plan, *, ttl: float | None = None, replace: bool = False,
       connect_timeout: float, view: ProgressView = no_view, packs: Sequence[sync.Pack] = ()) -> UpResult:
    """`dtf up`: start the plan's cluster and send it `packs` (the inventory's `sync:`, packed).

    1. plan: the record of a running cluster of that name decides. From the same inventory, the
       cluster is repaired instead (`repair`); from a changed one, `up` refuses (ClusterChanged),
       or with `replace` takes the old cluster down first.
    2. connect, prepare, start, verify: `start`, every host in parallel (rolled back unless all
       of it succeeds).
    3. record: the new cluster's record, saved once.
    """
    with state.locked():
        running = state.load(plan.cluster) if plan.cluster in state.names() else None
        retired: dict[str, str] = {}
        if running is not None and running.plan.retired and not replace:
            running, retired = clean_retired(running, connect_timeout, view)
        if running is not None and running.plan.moved:  # tasks moved to spares (dtf.hostops.repair)
            plan = plan.with_moves(running.plan.moved)
        changes = differences(running.plan, plan) if running is not None else []
        if running is not None and not changes:
            result = repair(running, plan, ttl, packs, connect_timeout, view)
            result.retired = retired
            return result
        if running is not None:
            if not replace:
                raise ClusterChanged(plan.cluster, running.inventory, plan.inventory, changes)
            teardown(running, keep_logs=False, grace=STOP_GRACE, connect_timeout=connect_timeout, view=view)
        t0 = time.monotonic()
        check_spares(plan, connect_timeout, view)
        ops = HostOps(plan, connect_timeout=connect_timeout, view=view)
        outcomes, sent = start(ops, None, packs)
        reports = syncing.reports(packs, sent)
        record = record_synced(new_record(plan, outcomes), reports)
        state.save(record)
    return UpResult(record, started=True, outcomes=outcomes, seconds=time.monotonic() - t0, synced=reports)


@contextlib.contextmanager
def allocated(inv: Inventory, *, wait: float, say: Callable[[str], None], connect_timeout: float,
              replace: bool = False, view: ProgressView = no_view, ttl: float | None = None
              ) -> Iterator[Allocation | None]:
    """`up`'s hosts, for the block that starts the cluster on them: the allocation its provider
    made or kept (dtf.providers.choose.allocated; None: the inventory's own hosts). The
    inventory's ssh_config is checked first (its mistakes at their line, not as ssh's failure)."""
    if inv.ssh_config:
        check_ssh_config(inv.position("ssh_config"), inv.ssh_config)

    def take_down(record: Record) -> None:  # `--replace` of a cluster whose allocation is taken back
        with state.locked():
            teardown(record, keep_logs=False, grace=STOP_GRACE, connect_timeout=connect_timeout, view=view, say=say)

    with providers.allocated(inv, wait=wait, say=say, connect_timeout=connect_timeout, replace=replace, ttl=ttl,
                             take_down=take_down) as allocation:
        yield allocation


def start(ops: HostOps, only: dict[str, set[str]] | None, packs: Sequence[sync.Pack] = ()
          ) -> tuple[dict[str, Outcome[HostStarted]], dict[str, Outcome[sync.HostSynced]]]:
    """Start the plan's tasks (or only some, per host) and send every host the packs, in phases:

    - connect, prepare and start, every host in parallel (`Starter.up`; on each host: connect,
      ship the launcher, check its python and TensorFlow or build its environment, start its
      servers, their TF ports closed to non-members first, check this machine reaches them);
    - send the packs to every host that lacks them;
    - verify: every host reaches every other host's tasks (the mesh check: in each host's start
      where they all start at once, `Starter(mesh=True)`; then from the hosts that did not).

    Unless every host succeeded in every phase, stop what was started and raise: HostFailure,
    or KeyboardInterrupt after Ctrl-C."""
    plan = ops.plan
    starter = Starter(ops, mesh=not packs)  # with packs, the mesh check comes last: it renews the lease
    failed: dict[str, str] = {}
    undo_failed: dict[str, str] = {}  # the hosts where the rollback failed
    succeeded = False
    sent: dict[str, Outcome[sync.HostSynced]] = {}

    def going() -> bool:
        return not failed and not ops.cancel.is_set()

    hosts = [hp for hp in plan.hosts if only is None or only.get(hp.name)]
    with ops.shown(f"dtf up {plan.cluster}", hosts), ctrl_c_sets(ops.cancel):
        try:
            outcomes = starter.up(only)
            failed = failures(outcomes)
            if packs and going():
                sent = syncing.send(ops, packs, syncing.hosts_of(plan))
                failed = {h: f"sync: {reason}" for h, reason in failures(sent).items()}
            if going():  # the hosts whose start did not check the mesh itself, or found a task it missed
                failed = failures(reach.check_mesh(ops, [hp for hp in plan.hosts if not (
                    hp.name in outcomes and outcomes[hp.name].ok and outcomes[hp.name].value.reached)]))
            succeeded = going()
        finally:
            if not succeeded:
                undo_failed = rollback(ops, starter, only)
                if only is None:  # a cluster that did not start keeps no connection either
                    ops.close_control()
                for host, why in undo_failed.items():
                    failed[host] = f"{failed.get(host, 'started')}; rollback failed: {why}"
    if ops.cancel.is_set():
        if undo_failed:  # never hidden behind "interrupted": tasks or files may be left there
            raise HostFailure("dtf up (interrupted)", {h: failed[h] for h in undo_failed})
        raise KeyboardInterrupt
    if failed:
        raise HostFailure("dtf up", failed)
    return outcomes, sent


def new_record(plan: Plan, outcomes: dict[str, Outcome[HostStarted]]) -> Record:
    """The record of a cluster every host of `plan` started (`outcomes`)."""
    client = next((o.value.client_address for o in outcomes.values() if o.value.client_address), None)
    remote = [outcomes[hp.name].value for hp in plan.remote_hosts]
    return Record(plan=plan, inventory=str(Path(plan.inventory).resolve()), created=time.time(),
                  chief_host=client or "127.0.0.1",  # the laptop as the hosts see it
                  pids={name: pid for o in outcomes.values() for name, pid in o.value.pids.items()},
                  network=route.decided_network(plan, {h: o.value.direct for h, o in outcomes.items()}),
                  tf_ports_open=any(h.direct for h in remote) if remote else True)


@contextlib.contextmanager
def ctrl_c_sets(event: threading.Event, signals: tuple[signal.Signals, ...] = (signal.SIGINT,)) -> Iterator[None]:
    """While inside: Ctrl-C (or any of `signals`) sets `event` instead of raising KeyboardInterrupt
    (in the main thread; elsewhere signals cannot be handled and nothing changes). A second Ctrl-C
    sets it again and nothing more: work that must finish (a rollback) is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        event.set()

    old = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def rollback(ops: HostOps, done: Starter, only: dict[str, set[str]] | None) -> dict[str, str]:
    """Undo what `done` did: stop the tasks it started and remove what it uploaded where it started
    nothing. With `only` (a repair), stop just the tasks it restarted: the others were serving.
    Returns the hosts where undoing failed, with the reason."""
    # A fresh HostOps: `ops` may be cancelled (Ctrl-C), and a cancelled one refuses every step.
    undo = HostOps(ops.plan, ops.progress, connect_timeout=ops.connect_timeout)
    undone: dict[str, Outcome[Any]]
    if only is None:
        started = tuple(hp for hp in ops.plan.hosts if hp.name in done.started)
        uploaded = tuple(hp for hp in ops.plan.hosts if hp.name in done.touched - done.started)
        undone = {**stop.down(undo, hosts=started), **stop.remove_launcher(undo, uploaded)}
        again = tuple(hp for hp in started if not undone[hp.name].ok)
        if again:  # a stop cut short (its command's deadline on a loaded host): once more, KILL at once
            undone.update(stop.down(undo, grace=0, hosts=again))
    else:
        undone = stop.stop_tasks(undo, {h: only[h] for h in only if h in done.started})
        again_only = {h: only[h] for h in only if h in undone and not undone[h].ok}
        if again_only:
            undone.update(stop.stop_tasks(undo, again_only, grace=0))
    return failures(undone)


# -- repair -----------------------------------------------------------------------------------
def repair(record: Record, plan: Plan, ttl: float | None, packs: Sequence[sync.Pack],
           connect_timeout: float, view: ProgressView = no_view) -> UpResult:
    """`dtf up` on a cluster that is up from the same inventory (`plan`): restart only the tasks
    that are not serving (their supervisor gave up, or was killed, or the host rebooted), then
    send the packs a host lacks; a new `--ttl` renews the lease with it first."""
    new_ttl = ttl if ttl is not None and any(hp.ttl != ttl for hp in record.plan.hosts) else None
    running = record.plan
    if new_ttl is not None:
        running = dataclasses.replace(running, hosts=tuple(dataclasses.replace(hp, ttl=new_ttl)
                                                           for hp in running.hosts))
    ops = HostOps(running, connect_timeout=connect_timeout, view=view)
    if new_ttl is not None:
        for o in lease.renew(ops, new_ttl).values():
            if not o.ok:
                raise HostFailure("dtf up (renewing the lease)", {o.host: o.reason})
        record = record.replace(plan=running)
        state.save(record)  # the hosts' leases changed: the record says so, whatever follows
    result = restart_dead(ops, record, Path(plan.inventory))
    result.new_ttl = new_ttl
    if packs:
        result.synced = send_packs(ops, packs)
        result.record = record_synced(result.record.replace(
            plan=dataclasses.replace(result.record.plan, sync=plan.sync)), result.synced)
        state.save(result.record)
    return result


def clean_retired(record: Record, connect_timeout: float, view: ProgressView = no_view
                  ) -> tuple[Record, dict[str, str]]:
    """Stop what still runs on the record's retired hosts (their tasks moved to a spare while
    they did not answer): the record without those now clean (saved), and those that could
    not be (host -> why), kept in it."""
    ops = HostOps(record.plan, connect_timeout=connect_timeout, view=view)
    with ops.shown(f"dtf up {record.cluster}: the hosts whose tasks moved to a spare", record.plan.retired):
        cleaned, failed = stop.clean_retired(ops)
    if cleaned:
        record = record.replace(plan=record.plan.without_retired(cleaned))
        state.save(record)
    return record, failed


def restart_dead(ops: HostOps, record: Record, inventory_path: Path) -> UpResult:
    """Restart the tasks of the running cluster that are not serving (and save their new pids)."""
    states = status.states(ops)
    unknown = {s.task.host: s.reason or "unknown" for s in states if s.state == "unknown"}
    if unknown:
        raise HostFailure("dtf up (checking the running cluster)", unknown)
    dead = [s for s in states if s.state != "alive"]
    if not dead:
        return UpResult(record, serving=len(states))
    t0 = time.monotonic()
    only = _by_host([(s.task.host, s.task.name) for s in dead])
    stop.stop_tasks(ops, only)  # supervisors that gave up
    outcomes, _ = start(ops, only)
    pids = dict(record.pids)
    for started in outcomes.values():
        pids.update(started.value.pids)
    notes = {s.task.name: restarted_note(f"`dtf up`; was {s.state}") for s in dead}
    record = record.replace(pids=pids, inventory=str(inventory_path.resolve()),
                            recovered={**record.recovered, **notes})
    state.save(record)
    return UpResult(record, outcomes=outcomes, seconds=time.monotonic() - t0,
                    restarted=[(s.task.name, s.state) for s in dead], serving=len(states) - len(dead))


def _by_host(tasks: list[tuple[str, str]]) -> dict[str, set[str]]:
    only: dict[str, set[str]] = {}
    for host, task in tasks:
        only.setdefault(host, set()).add(task)
    return only


# -- sync -------------------------------------------------------------------------------------
def send_packs(ops: HostOps, packs: Sequence[sync.Pack]) -> list[sync.Report]:
    """Make sure every host of a running cluster holds the packs (HostFailure: the hosts that
    do not). Nothing is stopped when a host fails: the cluster was up before."""
    hosts = syncing.hosts_of(ops.plan)
    with ops.shown(f"dtf sync {ops.plan.cluster}", hosts), ctrl_c_sets(ops.cancel):
        sent = syncing.send(ops, packs, hosts)
    if ops.cancel.is_set():
        raise KeyboardInterrupt
    return syncing.reports(packs, require_all("dtf sync", sent))


def record_synced(record: Record, reports: Sequence[sync.Report]) -> Record:
    """The record with what every host now holds, by name (a name synced again is replaced)."""
    return record.replace(synced={**record.synced, **{r.synced.name: r.synced for r in reports}})


def sync_to(name: str | None, packs: Sequence[sync.Pack], *, connect_timeout: float,
            view: ProgressView = no_view) -> tuple[Record, list[sync.Report]]:
    """`dtf sync`: send the packs to every host of a running cluster and record them. The state
    lock is held only to read and to write the record, not while the bytes travel."""
    with state.locked():
        record = state.load(state.resolve_name(name))
    reports = send_packs(HostOps(record.plan, connect_timeout=connect_timeout, view=view), packs)
    with state.locked():
        try:
            now = state.load(record.cluster)
        except NoCluster:
            now = None
        if now is None or now.created != record.created:
            raise NoCluster(f"cluster {record.cluster!r} was taken down (or replaced) while the data "
                            f"was being sent: run `dtf sync` again on the running cluster")
        record = record_synced(now, reports)
        state.save(record)
    return record, reports


# -- the record -------------------------------------------------------------------------------
def recorded(name: str | None) -> Record:
    """The record of the cluster named (or of the only one up): NoCluster where there is none."""
    with state.locked():
        return state.load(state.resolve_name(name))


# -- down -------------------------------------------------------------------------------------
@dataclass
class DownResult:
    cluster: str
    outcomes: dict[str, Outcome[HostStopped]]
    seconds: float

    @property
    def stopped(self) -> int:
        """Servers that were running and were stopped."""
        return sum(1 for o in self.outcomes.values() for s in o.value.stopped.values() if s.was_running)


def down(name: str | None, *, keep_logs: bool, grace: float, connect_timeout: float,
         view: ProgressView = no_view, purge: bool = False,
         say: Callable[[str], None] = lambda line: None) -> DownResult | None:
    """Stop every task of the cluster, remove dtf's files from its hosts and forget it; with
    `purge`, also each host's WORKDIR/.cache (managed environments, wheels, synced trees).
    None where there is no such cluster: taking down what is not up has nothing to do (a
    detached run's outputs are brought back before: dtf.detached.attach.settle)."""
    with state.locked():
        recorded = state.names()
        if (name not in recorded) if name else not recorded:
            return None
        record = state.load(state.resolve_name(name))
        t0 = time.monotonic()
        outcomes = teardown(record, keep_logs=keep_logs, grace=grace, connect_timeout=connect_timeout,
                            view=view, purge=purge, say=say)
    return DownResult(record.cluster, outcomes, time.monotonic() - t0)


def teardown(record: Record, *, keep_logs: bool, grace: float, connect_timeout: float,
             view: ProgressView = no_view, purge: bool = False,
             say: Callable[[str], None] = lambda line: None) -> dict[str, Outcome[HostStopped]]:
    """Stop every task and remove the files, on the plan's hosts and on those whose tasks moved
    to a spare (their old tasks may run on there); forget the cluster, or keep the hosts that
    failed in the record so that a later `dtf down` retries them."""
    plan = record.plan
    record = record.replace(taking_down=True)
    state.save(record)  # a `dtf train` on this cluster sees it and stops its program
    ops = HostOps(plan, connect_timeout=connect_timeout, view=view)
    provider = ops.provider
    if provider.gone():
        # The allocation's end stopped every task (a job cancelled, timed out): nothing of dtf's
        # runs there, and the hosts are no longer ours to reach.
        say(provider.gone_line())
        provider.close()
        state.remove(plan.cluster)
        return {}
    hosts = (*plan.hosts, *plan.retired)
    with ops.shown(f"dtf down {plan.cluster}", hosts):
        outcomes = stop.down(ops, keep_logs=keep_logs, grace=grace, purge=purge, hosts=hosts)
    failures = {h: o.reason for h, o in outcomes.items() if not o.ok}
    for host, reason in stop.clean_spares(ops).items():  # a detached run's key there, if any
        say(f"warning: spare {host}: {reason} (a detached run's key there ends with its expiry-time)")
    # Over the provider's connections still (no new handshake); then every one is closed.
    released = provider.release(say)
    provider.close()
    if released:
        # The allocation dtf made is gone, whatever the hosts said: its end stopped every task.
        for host, reason in failures.items():
            say(f"{host}: {reason} (its steps ended with the job)")
        outcomes = {h: o for h, o in outcomes.items() if o.ok}
        failures = {}
    if failures:
        kept = tuple(hp for hp in plan.hosts if hp.name in failures)
        state.save(record.replace(plan=dataclasses.replace(plan, hosts=kept).without_retired(
            [hp.name for hp in plan.retired if hp.name not in failures])))
        raise HostFailure("dtf down", {h: f"{r} (kept in the record: run `dtf down` again)"
                                       for h, r in failures.items()})
    state.remove(plan.cluster)
    return outcomes
