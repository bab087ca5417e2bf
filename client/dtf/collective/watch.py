"""One attempt of a collective run (dtf.collective.run), followed until every copy has ended.

Each copy's follower (dtf.collective.follow) puts its events on one queue; the attempt moves
through named states, each transition one short method:

    JOINING   --every copy joined-->                          RUNNING
    JOINING   --the start deadline passed-->                  STOPPING
    JOINING,
    RUNNING   --the chief ended well-->                       FINISHING
    FINISHING --the others did not end within FINISH_GRACE--> STOPPING
    any       --a copy failed, Ctrl-C, `dtf down`-->          STOPPING

In STOPPING every copy is being stopped (TERM, then KILL); a copy whose host says nothing more
after the stop's own deadline is counted lost. The attempt is over once every copy has ended.
"""

from __future__ import annotations

import enum
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dtf.cluster.plan import Plan, TaskPlan
from dtf.collective import follow
from dtf.errors import DtfError
from dtf.program import noise
from dtf.program.train import NoFigures, RunFigures

FINISH_GRACE = 60.0  # seconds the other copies get to end once the chief ended well
LAST_LINES = 5
TAKEN_DOWN_EVERY = 1.0  # seconds between looks at whether `dtf down` is taking the cluster down


class StartDeadline(DtfError):
    """Not every copy joined within the start deadline."""


@dataclass(frozen=True)
class Failure:
    task: str
    host: str
    reason: str  # "exited with code 1", "killed by SIGKILL", "host lost: ..."
    last_lines: tuple[str, ...]
    lost: bool  # a copy killed or a host lost, not the program's own error: worth an attempt again

    def describe(self) -> str:
        tail = " | ".join(line.strip() for line in self.last_lines if line.strip())
        return f"{self.task} ({self.host}) failed first: {self.reason}" + (f"; last lines: {tail}" if tail else "")


@dataclass
class Attempt:
    """How one run of every copy ended."""

    chief_code: int | None = None
    failure: Failure | None = None
    interrupted: bool = False
    taken_down: bool = False
    ended: dict[str, follow.Ended | follow.Lost] = field(default_factory=dict)


def lost_or_killed(event: follow.Ended | follow.Lost) -> bool:
    """A copy that did not end by itself: killed by a signal, or its host lost."""
    return isinstance(event, follow.Lost) or event.code is None or event.code < 0


def exit_code(code: int | None) -> int:
    """A copy's exit status as a shell reports it (a signal N: 128 + N)."""
    if code is None:
        return 137
    return 128 - code if code < 0 else code


def prefix(task: TaskPlan) -> str:
    return f"[{task.name} {task.host}] "


def say(message: str) -> None:
    print(f"dtf: {message}", file=sys.stderr, flush=True)


def end_reason(event: follow.Ended | follow.Lost) -> str:
    return event.reason if isinstance(event, follow.Ended) else f"host lost: {event.reason}"


class Run(Protocol):
    """What a watch asks of its run (dtf.collective.run.CollectiveRun)."""

    plan: Plan
    workers: list[TaskPlan]
    join_timeout: float
    grace: float
    host_lost: float
    connect_timeout: float
    verbose: bool
    figures: RunFigures | NoFigures
    taken_down: Callable[[], bool]

    def stop(self, what: str) -> dict[str, str]: ...

    def diagnose(self, pending: list[TaskPlan]) -> tuple[str, bool]: ...


class State(enum.Enum):
    JOINING = "joining"  # not every copy has joined the others: the start deadline applies
    RUNNING = "running"  # every copy joined
    FINISHING = "finishing"  # the chief ended well: the others get FINISH_GRACE to end as well
    STOPPING = "stopping"  # every copy is being stopped: waiting for their ends


class Watch:
    """Follow every copy of `run` until all have ended; stop them all at the first failure, at the
    start deadline, on Ctrl-C (`interrupted`), or when the cluster is taken down."""

    def __init__(self, run: Run, interrupted: threading.Event) -> None:
        self.run, self.interrupted = run, interrupted
        self.workers = run.workers
        self.by_name = {t.name: t for t in self.workers}
        self.events: queue.Queue[follow.Event] = queue.Queue()
        self.stop_following = threading.Event()
        self.result = Attempt()
        self.last: dict[str, deque[str]] = {t.name: deque(maxlen=LAST_LINES) for t in self.workers}
        # What is printed and quoted is the program's own output, as under `dtf train`: a copy's
        # log holds TensorFlow's C++ chatter too, and its last lines are often nothing else.
        self.chatter = {t.name: noise.NoiseFilter() for t in self.workers}
        self.joined: set[str] = set()
        self.copies = {t.name: {"host": t.host, "joined": False, "state": "starting"} for t in self.workers}
        self.silent_since: dict[str, float] = {}  # tasks whose host has said nothing for follow.SILENT
        self.state = State.JOINING
        self.since = 0.0  # when the state was entered (time.monotonic)
        self.deadline = 0.0  # the start deadline
        self.checked = 0.0  # the last look at whether the cluster is being taken down
        self.stopper: threading.Thread | None = None  # dtf's stop of every copy (none under `dtf down`)
        self.start_error: str | None = None

    # -- the loop -----------------------------------------------------------------------------
    def watch(self) -> Attempt:
        for t in self.workers:
            threading.Thread(target=follow.follow_task, name=f"dtf-follow-{t.name}", daemon=True,
                             args=(self.run.plan, t, self.events, self.stop_following, self.run.connect_timeout,
                                   self.run.host_lost)).start()
        self.run.figures.update(copies=self.copies)
        now = time.monotonic()
        self.since = self.checked = now
        self.deadline = now + self.run.join_timeout
        try:
            while len(self.result.ended) < len(self.workers):
                try:
                    event: follow.Event | None = self.events.get(timeout=0.2)
                except queue.Empty:
                    event = None
                now = time.monotonic()
                if event is not None:
                    self.on_event(event, now)
                self.on_tick(now)
        finally:
            self.stop_following.set()
            if self.stopper is not None:
                self.stopper.join(timeout=self.run.grace + 60)
        if self.start_error is not None and not self.result.interrupted:
            raise StartDeadline(self.start_error)
        return self.result

    def enter(self, state: State, now: float) -> None:
        self.state, self.since = state, now

    def show(self, task: str, **changes: Any) -> None:  # for `dtf top` (dtf.program.figures' run.json)
        self.copies[task].update(changes)
        self.run.figures.update(copies=self.copies)

    def pending(self) -> list[TaskPlan]:
        """The copies that have neither joined nor ended."""
        return [t for t in self.workers if t.name not in self.joined and t.name not in self.result.ended]

    # -- events from the followers ---------------------------------------------------------------
    def on_event(self, event: follow.Event, now: float) -> None:
        if isinstance(event, follow.Line):
            self.on_line(event)
        elif isinstance(event, follow.Joined):
            self.on_joined(event, now)
        elif isinstance(event, follow.Silent):
            self.silent_since[event.task] = now - event.seconds
        elif isinstance(event, follow.Heard):
            self.silent_since.pop(event.task, None)
        elif isinstance(event, (follow.Ended, follow.Lost)) and event.task not in self.result.ended:
            self.on_end(event, now)

    def on_line(self, event: follow.Line) -> None:
        if self.run.verbose or self.chatter[event.task].keeps(event.text):
            self.last[event.task].append(event.text)
            print(prefix(self.by_name[event.task]) + event.text, flush=True)

    def on_joined(self, event: follow.Joined, now: float) -> None:
        self.joined.add(event.task)
        self.show(event.task, joined=True, state="running")
        if self.state is State.JOINING and len(self.joined) == len(self.workers):
            self.enter(State.RUNNING, now)

    def on_end(self, event: follow.Ended | follow.Lost, now: float) -> None:
        self.result.ended[event.task] = event
        reason = end_reason(event)
        self.show(event.task, state=reason)
        task = self.by_name[event.task]
        ok = isinstance(event, follow.Ended) and event.code == 0
        if task.index == 0 and isinstance(event, follow.Ended):
            self.result.chief_code = exit_code(event.code)
            if ok and self.state in (State.JOINING, State.RUNNING):
                self.enter(State.FINISHING, now)
        if not ok and self.state is not State.STOPPING:
            self.on_failure(task, event, reason, now)

    def on_failure(self, task: TaskPlan, event: follow.Ended | follow.Lost, reason: str, now: float) -> None:
        """The first copy that failed: named (or the host that went silent before it), and every
        copy stopped."""
        failure = Failure(task.name, task.host, reason, tuple(self.last[task.name]), lost_or_killed(event))
        if not failure.lost:
            failure = self.silent_host(task, reason, now) or failure
        self.result.failure = failure
        pending = self.pending()
        if pending and not failure.lost:
            # Before all joined: did TensorFlow give up on a peer it cannot reach?
            why, blocked = self.run.diagnose(pending)
            if blocked:
                self.start_error = f"the copies could not join: {why}"
        self.stop_all(f"{task.name} ({task.host}) {reason}", now)

    def silent_host(self, task: TaskPlan, reason: str, now: float) -> Failure | None:
        """A copy failed while another host has been silent: TensorFlow saw that host go (its
        heartbeats stopped) before dtf's HOST_LOST; the failure is that host's."""
        quiet = [t for t in self.workers if t.name in self.silent_since and t.name != task.name
                 and t.name not in self.result.ended]
        if not quiet:
            return None
        gone = min(quiet, key=lambda t: self.silent_since[t.name])
        return Failure(gone.name, gone.host,
                       f"host lost: no word from {gone.host} for {now - self.silent_since[gone.name]:.0f}s; "
                       f"then {task.name} ({task.host}) {reason}", tuple(self.last[task.name]), True)

    # -- the clock, Ctrl-C and `dtf down` --------------------------------------------------------
    def on_tick(self, now: float) -> None:
        if self.interrupted.is_set() and not self.result.interrupted:
            self.result.interrupted = True
            self.stop_all("interrupted", now)
        if now - self.checked >= TAKEN_DOWN_EVERY:
            self.checked = now
            self.check_taken_down(now)
        if self.state is State.JOINING and now > self.deadline:
            self.start_deadline_passed(now)
        if self.state is State.FINISHING and now - self.since > FINISH_GRACE:
            self.stop_all(f"the chief ended {FINISH_GRACE:g}s ago", now)
        if self.state is State.STOPPING and now - self.since > self.run.grace + self.run.host_lost + 30:
            for t in self.workers:  # a lost host's follower may never say more
                self.result.ended.setdefault(t.name, follow.Lost(t.name, "no word after the stop"))

    def check_taken_down(self, now: float) -> None:
        if self.state is not State.STOPPING and self.run.taken_down():
            self.result.taken_down = True
            self.enter(State.STOPPING, now)  # `dtf down` stops the copies itself
            say(f"cluster {self.run.plan.cluster!r} is being taken down (`dtf down`)")

    def start_deadline_passed(self, now: float) -> None:
        pending = self.pending()
        if pending:
            why, _ = self.run.diagnose(pending)
            self.start_error = f"start deadline ({self.run.join_timeout:g}s, --join-timeout) passed: {why}"
            self.stop_all(f"start deadline ({self.run.join_timeout:g}s) passed", now)

    def stop_all(self, why: str, now: float) -> None:
        if self.state is State.STOPPING:
            return
        say(f"stopping every copy: {why}")
        self.stopper = threading.Thread(target=self.run.stop, args=("stop",), name="dtf-stop-copies", daemon=True)
        self.stopper.start()
        self.enter(State.STOPPING, now)
