"""Runs that outlive their machines: while `dtf train` runs, a `Repair` watches every host and
brings back what is lost.

- A task whose supervisor is gone (killed, its host rebooted, the OOM killer) or gave up is
  started again on its host, as `dtf up` again would, without touching the tasks that serve. A
  worker comes back at its address and the coordinator takes it back; a ps restarted so makes
  the program's next attempt (dtf.program.train) resume from its last checkpoint.
- A host whose tasks moved away (a `retired` host of the plan) and that answers again has the old
  tasks it still runs stopped, and its files removed: they would hold its ports for the lease's
  life. Tried every RETIRED_EVERY seconds while the run goes on.
- A host that has not answered for the plan's `host_timeout` while the others did is lost for
  good: its tasks move to the first spare (the inventory's `spares:`) that starts them, on the same
  ports; the cluster's record holds the new placement. A host's silence counts only while this
  machine listens: while some host answers it, and while the repair itself runs (its looks come
  on time). When every host is silent at once, or the looks stop coming, the silence is this
  machine's (its network dropped, it slept, or its processes were stopped), and no host is blamed
  for it: every host's count pauses until this machine hears from a host again.
  ParameterServerStrategy cannot change a task's address inside a run, so the program is stopped
  and its next attempt resumes from its last checkpoint. No spare left: `lost` says so in one
  line, and the run ends.

The hosts are not asked: the repair reads a `Watch` (dtf.hostops.watch, as `dtf top` does), one
SSH session per host for the whole run on which the launcher's `top --states-only` pushes every
task's state each `WATCH_EVERY` seconds. A host has answered when its last sample came; a silent
stream is connected again by the watch. A repair runs in a thread of its own per host (a host
whose link is down holds only its own thread). The lease is the lease keeper's (`dtf.hostops.lease`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable

from dtf.cluster import state
from dtf.cluster.plan import HostPlan, Plan
from dtf.cluster.state import Record
from dtf.errors import ClusterDown, DtfError, HostFailure
from dtf.hostops import reach, stop
from dtf.hostops.parallel import HostOps, ProgressView, failures, no_view
from dtf.hostops.start import Starter, local_tf_version
from dtf.hostops.status import FILES_GONE
from dtf.hostops.watch import HostFeed, Watch
from dtf.providers.choose import provider_for

WATCH_EVERY = 2.0  # seconds between two samples of a host's task states
# A host answered "lately" (and so this machine listens) when its last sample is at most this many
# samples old: a sample may come a little late without a host's silence counting.
STALE_AFTER = 3
RETIRED_EVERY = 10.0  # seconds between two tries at a retired host's old tasks
# A task in one of these states has nothing on its host that brings it back: dtf starts it again.
NEEDS_START = ("dead", "failed")


def clock() -> str:
    return time.strftime("%H:%M:%S")


def restarted_note(why: str | None) -> str:
    """What `status` and `top` show of a task dtf started again."""
    return f"restarted by dtf at {clock()} ({why or 'not running'})"


def moved_note(lost: str, spare: str, waited: float) -> str:
    return f"moved from {lost} to spare {spare} at {clock()} ({lost} unanswered for {waited:.0f}s)"


def no_spare_line(plan: Plan, lost: HostPlan, waited: float) -> str:
    """The one line a run ends with when a host is lost and no spare can take its tasks."""
    tasks = ", ".join(t.name for t in lost.tasks)
    return (f"cluster {plan.cluster!r}: host {lost.name} unanswered for {waited:.0f}s (host_timeout "
            f"{plan.host_timeout:g}s) and no spare left to take its tasks ({tasks})")


def check_spares(plan: Plan, connect_timeout: float, view: ProgressView = no_view) -> None:
    """`up`: each spare can take tasks (reached by SSH, its python with this machine's
    TensorFlow); nothing is left on it. HostFailure naming each spare that cannot."""
    if not plan.spares:
        return
    ops = HostOps(dataclasses.replace(plan, hosts=plan.spares), connect_timeout=connect_timeout, view=view)
    starter = Starter(ops)
    version = local_tf_version()

    def check(sp: HostPlan) -> None:
        ops.step(sp, "connecting")
        with ops.runner(sp) as t:
            starter._check(t, sp, version, ())

    with ops.shown(f"dtf up {plan.cluster}: checking the spares"):
        checked = ops.each_host(check, at_once=ops.at_once())
        touched = [sp for sp in plan.spares if sp.name in starter.touched]
        cleaned = stop.remove_launcher(ops, touched)
    failed = {h: f"spare: {why}" for h, why in {**failures(cleaned), **failures(checked)}.items()}
    if failed:
        raise HostFailure("dtf up", failed)


def answered_or_moved(record: Record, hosts: list[str], connect_timeout: float,
                      say: Callable[[str], None]) -> Record:
    """Collective mode, after an attempt that lost `hosts`: wait until each answers again, or,
    past the plan's `host_timeout`, has its tasks moved to a spare in the record (nothing is
    started there: the next attempt's copies take the ports). The record as it is then;
    ClusterDown with the one line where a host is lost and no spare is left."""
    repair = Repair(record, connect_timeout, say, restart=False)
    begun = time.monotonic()  # after the repair's start: a host answers with a sample from now on
    with repair:
        while True:
            if repair.lost is not None:
                raise ClusterDown(repair.lost)
            names = {hp.name for hp in repair.plan.hosts}
            with repair.lock:
                if all(h not in names or repair.answered.get(h, 0) > begun for h in hosts):
                    return repair.record
            time.sleep(WATCH_EVERY / 4)


def dead_tasks(hp: HostPlan, feed: HostFeed) -> dict[str, str | None]:
    """The host's tasks its latest sample shows in need of a start (name -> why)."""
    if feed.files_gone:
        return {t.name: FILES_GONE.format(root=hp.root) for t in hp.tasks}
    gone: dict[str, str | None] = {}
    tasks = feed.sample.tasks if feed.sample is not None else {}
    for t in hp.tasks:
        s = tasks.get(t.name)
        if s is None or s.status.state in NEEDS_START:
            gone[t.name] = s.status.reason if s is not None else "not reported by its host"
    return gone


class Repair:
    """Watches the hosts of a running cluster and brings its tasks back (see the module).

    `record` follows every change (`changes` counts the moves); `say` is told each repair in one
    line; `on_plan` gets each new plan (the lease keeper's hosts). `restart` False: tasks are not
    started again, nor started on a spare (collective mode: the copies hold the worker ports)."""

    def __init__(self, record: Record, connect_timeout: float, say: Callable[[str], None],
                 on_plan: Callable[[Plan], None] = lambda plan: None, restart: bool = True,
                 every: float = WATCH_EVERY) -> None:
        self.record = record
        self.connect_timeout = connect_timeout
        self.say = say
        self.on_plan = on_plan
        self.restart = restart
        self.every = every
        self.lock = threading.RLock()  # the record, `answered`, a move
        self.stopped = threading.Event()
        self.changes = 0  # moves made: a running program's addresses changed
        self.lost: str | None = None  # a host lost with no spare left: the line the run ends with
        now = time.monotonic()
        self.answered = {hp.name: now for hp in record.plan.hosts}  # host -> when it last answered
        # Seconds this machine has listened since the start (`listen`), and each host's count of
        # them when it last answered: its silence while this machine listened is the difference.
        self.listened = 0.0
        self.marks: dict[str, float] = {hp.name: 0.0 for hp in record.plan.hosts}
        self.looked = now  # when the last look ran
        self.retiring: threading.Thread | None = None  # stopping what the retired hosts still run
        self.retired_tried = 0.0  # when it last began
        self.read: dict[str, float] = {}  # host -> when the last sample acted upon came
        self.repairing: set[str] = set()  # hosts whose tasks are being started again
        self.failed = False  # a repair raised (a bug): said once
        self.watch = Watch(HostOps(record.plan, connect_timeout=connect_timeout), every, states_only=True)
        self.thread = threading.Thread(target=self._run, name="dtf-repair", daemon=True)

    @property
    def plan(self) -> Plan:
        return self.record.plan

    def __enter__(self) -> Repair:
        # On a Slurm allocation each node's feed is one long job step; a dead task is started
        # again there as on a host. A node is never moved (no spares): a job that ends is
        # replaced as a whole (dtf.program.train, dtf.providers.slurm.reallocate).
        self.watch.__enter__()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.watch.changed.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.connect_timeout + 60)
        self.watch.__exit__()

    # -- watching ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopped.is_set():
            self.watch.changed.wait(self.every)
            self.watch.changed.clear()
            if not self.stopped.is_set():
                self._guarded(self.look)

    def _guarded(self, step: Callable[[], None]) -> None:
        """A bug in a repair is said once and written to $DTF_HOME/debug.log; the run goes on."""
        try:
            step()
        except Exception as e:  # the training must not end with the watcher
            import traceback

            with contextlib.suppress(OSError), open(state.home() / "debug.log", "a") as log:
                log.write(f"--- dtf train's repair, {time.ctime()}\n{traceback.format_exc()}")
            if not self.failed:
                self.failed = True
                self.say(f"warning: dead tasks and lost hosts are not repaired: {type(e).__name__}: {e} "
                         f"(traceback in {state.home() / 'debug.log'})")

    def look(self) -> None:
        """Read every host's latest sample: its dead tasks are started again (in a thread of the
        host's own); move the tasks of each host silent past the timeout."""
        with self.lock:
            plan = self.plan
            feeds = self.watch.feeds()
            self.listen(time.monotonic())
            for hp in plan.hosts:
                feed = feeds.get(hp.name)
                if feed is None or feed.at is None or feed.at <= self.read.get(hp.name, 0.0):
                    continue
                self.answered[hp.name] = max(self.answered.get(hp.name, 0.0), feed.at)
                self.marks[hp.name] = self.listened
                if hp.name in self.repairing:
                    continue  # a sample from before the repair ended: the next one says
                self.read[hp.name] = feed.at
                gone = dead_tasks(hp, feed)
                if gone and self.restart and not self.stopped.is_set():
                    self.repairing.add(hp.name)
                    threading.Thread(target=self._guarded, args=(lambda hp=hp, gone=gone: self._repair(hp, gone),),
                                     name=f"dtf-repair-{hp.name}", daemon=True).start()
            if plan.retired and self.restart and not self.stopped.is_set() and (
                    self.retiring is None or not self.retiring.is_alive()) and (
                    time.monotonic() - self.retired_tried >= RETIRED_EVERY):
                self.retired_tried = time.monotonic()
                self.retiring = threading.Thread(target=self._guarded, args=(self._clean_retired,),
                                                 name="dtf-repair-retired", daemon=True)
                self.retiring.start()
            if self.lost is not None or self.watch.ops.provider.ends:
                return  # hosts whose allocation can end are lost with it: replaced as a whole
            for hp in plan.hosts:
                waited = self.listened - self.marks.get(hp.name, self.listened)
                if waited > plan.host_timeout and not self.stopped.is_set():
                    self._move(hp, waited)

    def listen(self, now: float) -> None:
        """Count the time since the last look as listened, where this machine listened meanwhile:
        its look came on time (it was not stopped or asleep) and some host answered it lately (its
        network is up)."""
        elapsed, self.looked = now - self.looked, now
        fresh = STALE_AFTER * self.every
        if elapsed <= fresh and any(now - at <= fresh for at in self.answered.values()):
            self.listened += elapsed

    def _repair(self, hp: HostPlan, gone: dict[str, str | None]) -> None:
        try:
            self._restart(hp, gone)
        finally:
            with self.lock:
                self.repairing.discard(hp.name)
                self.read[hp.name] = time.monotonic()  # the samples that came meanwhile are stale

    # -- repairs ----------------------------------------------------------------------------------
    def going_down(self) -> bool:
        """`dtf down` has begun (its stopped tasks are not brought back), or the record is gone."""
        try:
            now = state.load(self.record.cluster)
        except DtfError:
            return True
        return now.taking_down or now.created != self.record.created

    def job_ended(self) -> bool:
        """A Slurm cluster's job no longer runs (its tasks died with it): the attempt loop gets a
        new allocation (dtf.providers.slurm.reallocate); nothing is started on the old one."""
        return provider_for(self.plan, self.connect_timeout).ended("dtf train") is not None

    def _restart(self, hp: HostPlan, gone: dict[str, str | None]) -> None:
        """Start the host's tasks in `gone` (name -> why) again; the others keep serving."""
        with self.lock:
            plan = self.plan
            if hp not in plan.hosts or self.going_down() or self.job_ended():
                return
            ops = HostOps(plan, connect_timeout=self.connect_timeout)
            only = {hp.name: set(gone)}
            stop.stop_tasks(ops, only)  # a supervisor that gave up
            outcome = Starter(ops).up(only)[hp.name]
            names = ", ".join(sorted(gone))
            if not outcome.ok:
                stop.stop_tasks(ops, only, grace=0)
                self.say(f"{names} on {hp.name} could not be started again: {outcome.reason}")
                return
            why = next(iter(gone.values()))
            self._save(plan, outcome.value.pids, {name: restarted_note(gone[name]) for name in gone})
            self.say(f"{names} on {hp.name} started again ({why or 'not running'})")

    def _clean_retired(self) -> None:
        """Stop what the retired hosts that answer still run (stop.clean_retired); say it once each."""
        with self.lock:
            plan = self.plan
        if not plan.retired or self.going_down():
            return
        cleaned, _ = stop.clean_retired(HostOps(plan, connect_timeout=self.connect_timeout))
        if not cleaned:
            return
        with self.lock:
            self.record = self.record.replace(plan=self.record.plan.without_retired(cleaned))
            self._save(self.record.plan, {}, {})
        moved = dict(plan.moved)
        for host in cleaned:
            self.say(f"host {host} answers again: the tasks it ran before they moved to spare "
                     f"{moved.get(host, '?')} are stopped")

    def _move(self, lost: HostPlan, waited: float) -> None:
        """Move the lost host's tasks to the first spare that starts them; `lost` if none does."""
        plan = self.plan
        if self.going_down():
            return
        only_names = {t.name for t in lost.tasks}
        while plan.spares:
            spare = plan.spares[0]
            new = plan.moved_to(lost.name, spare.name)
            if not self.restart:
                break
            ops = HostOps(new, connect_timeout=self.connect_timeout)
            only = {spare.name: only_names}
            outcome = Starter(ops).up(only)[spare.name]
            if outcome.ok:
                pids = outcome.value.pids
                break
            stop.stop_tasks(ops, only, grace=0)
            self.say(f"spare {spare.name} cannot take the tasks of {lost.name}: {outcome.reason}")
            plan = dataclasses.replace(plan, spares=plan.spares[1:])
        else:
            self.lost = no_spare_line(plan, lost, waited)
            self.changes += 1
            return
        if not self.restart:
            pids = {}
        self.answered.pop(lost.name, None)
        self.marks.pop(lost.name, None)
        self.read.pop(lost.name, None)
        self.answered[spare.name] = time.monotonic()
        self.marks[spare.name] = self.listened
        self.watch.follow(HostOps(new, connect_timeout=self.connect_timeout))
        self._save(new, pids, {name: moved_note(lost.name, spare.name, waited) for name in only_names},
                   gone=only_names)
        self.changes += 1
        self.on_plan(new)
        self.say(f"host {lost.name} unanswered for {waited:.0f}s: {', '.join(sorted(only_names))} moved "
                 f"to spare {spare.name}")

    def _save(self, plan: Plan, pids: dict[str, int], notes: dict[str, str], gone: set[str] | None = None) -> None:
        """The record with `plan`, the new pids and notes: here, and on disk unless the cluster
        is being taken down (or was replaced)."""
        kept = {k: v for k, v in self.record.pids.items() if k not in (gone or ())}
        self.record = self.record.replace(plan=plan, pids={**kept, **pids},
                                          recovered={**self.record.recovered, **notes})
        with state.locked(wait=30):
            try:
                now = state.load(self.record.cluster)
            except DtfError:
                return
            if now.taking_down or now.created != self.record.created:
                return
            state.save(now.replace(plan=self.record.plan, pids=self.record.pids, recovered=self.record.recovered))

    # -- for the attempt loop ---------------------------------------------------------------------
    def stop_reason(self, changes: int) -> str | None:
        """Why the running program must stop (its cluster changed since `changes`), else None."""
        if self.lost is not None:
            return "a host is lost and no spare is left: stopping the program"
        if self.changes > changes:
            return "tasks moved to a spare: stopping the program, whose next attempt uses the new placement"
        return None

    def wait_serving(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Wait until every task of the (current) plan accepts connections from here, while the
        hosts are repaired; the ones that still do not after `timeout` seconds (plus the host
        timeout, where a task's host has not answered since the wait began), or as soon as
        `stop()` says so."""
        begun = time.monotonic()
        while True:
            if self.lost is not None:
                return []
            plan = self.plan
            ops = HostOps(plan, connect_timeout=self.connect_timeout)
            dead = reach.unreachable(ops, self.record.network, reach.PROBE_TIMEOUT)
            if not dead:
                return []
            with self.lock:
                silent = any(self.answered.get(t.host, 0) < begun for t in dead)
            end = begun + timeout + (plan.host_timeout if silent else 0)
            if time.monotonic() >= end or stop():
                return [f"{t.name} ({t.host}, {t.address})" for t in dead]
            time.sleep(0.5)
