"""The training figures `dtf top` shows, published by the program's hooks (and by `dtf train`
itself) as small JSON files in the laptop's `$DTF_HOME/live/CLUSTER/`:

    train.json   the program's (ParameterServerStrategy): steps and steps/s overall and per
                 worker (and per worker its closures, and the time they took), closures in
                 flight, steps per closure, the last failure or retry
    run.json     `dtf train`'s: the attempt, its limit, the last lost ps it retried after; in
                 collective mode the copies (state, joined, attempt)

Each is rewritten at most once a second, by a daemon thread, never by the training's own
threads, and atomically (written beside, then renamed): a reader never sees half of one. The
training's threads only add to counters (`Figures.closure_done`), a lock and a few additions.

When the program ends, `dtf train` reads its last train.json into the run's `Shares` (summed
over its attempts): what each worker did, printed after the run (dtf.ui.show_shares).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtf_server.protocol import Layout

ENV = "DTF_FIGURES"  # the directory: set by `dtf train` for the program ("off": publish nothing)
TRAIN = Layout.TRAIN  # "train.json"
RUN = "run.json"
PERIOD = 1.0  # seconds between two writes, at most one write per period
SCHEMA = 1

next_steps = 1  # the steps of the next closure the program schedules (fit's data handler, dtf.packing())
told = False  # whether fit or dtf.packing() set next_steps: else a closure is the program's own, of steps unknown


def live_dir(home: Path, cluster: str) -> Path:
    return home / "live" / cluster


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def leftovers(directory: Path) -> list[Path]:
    """write_atomic's temporary files in `directory`: a writer killed between its write and its
    rename leaves one."""
    return list(directory.glob(".*.tmp"))


def read(path: Path) -> dict[str, Any] | None:
    """A published file, or None (absent, or not ours)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


class Figures:
    """The program's training figures; `start()` publishes them every PERIOD seconds."""

    def __init__(self, path: Path, attempt: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.attempt, self.clock = path, attempt, clock
        self.lock = threading.Lock()
        self.steps: dict[int, int] = {}  # worker index -> steps done
        self.done: dict[int, int] = {}  # worker index -> closures done
        self.busy: dict[int, float] = {}  # worker index -> seconds its closures took, round trips included
        self.unknown: dict[int, int] = {}  # worker index -> closures of steps dtf was not told (1 step each in `steps`)
        self.closures = 0
        self.steps_per_closure: int | None = None
        self.packing: str | None = None  # how the steps per closure were chosen
        self.last_failure: str | None = None
        self.retries = 0
        self.resumed_at_step: int | None = None  # the step a fit restored from its backup resumes at
        self.in_flight: Callable[[], int | None] = lambda: None
        self._previous: tuple[float, dict[int, int]] | None = None
        self._rates: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.time()

    def closure_done(self, worker: int, steps: int, seconds: float = 0.0, told: bool = True) -> None:
        """A closure of `steps` steps ran on `worker`, taking `seconds`; `told`: fit or
        dtf.packing() said its steps (else: a function the program schedules itself, or one of
        evaluate()'s shards, counted as 1 step)."""
        with self.lock:
            self.steps[worker] = self.steps.get(worker, 0) + steps
            self.done[worker] = self.done.get(worker, 0) + 1
            self.busy[worker] = self.busy.get(worker, 0.0) + seconds
            if not told:
                self.unknown[worker] = self.unknown.get(worker, 0) + 1
            self.closures += 1

    def failed(self, what: str, retried: bool) -> None:
        with self.lock:
            self.last_failure = what[:300]
            if retried:
                self.retries += 1

    def snapshot(self) -> dict[str, Any]:
        """The document, with steps/s per worker since the previous snapshot."""
        now = self.clock()
        with self.lock:
            steps, done, busy, unknown = dict(self.steps), dict(self.done), dict(self.busy), dict(self.unknown)
            closures = self.closures
            failure, retries = self.last_failure, self.retries
        if self._previous is not None and now > self._previous[0]:
            then, before = self._previous
            self._rates = {w: (n - before.get(w, 0)) / (now - then) for w, n in steps.items()}
        self._previous = (now, steps)
        try:
            in_flight = self.in_flight()
        except Exception:  # a coordinator being torn down: no figure this time
            in_flight = None
        return {"schema": SCHEMA, "kind": "ps", "pid": os.getpid(), "time": time.time(), "started": self.started,
                "attempt": self.attempt, "steps": sum(steps.values()), "closures": closures,
                "steps_per_s": round(sum(self._rates.values()), 2),
                "workers": {str(w): {"steps": n, "steps_per_s": round(self._rates.get(w, 0.0), 2),
                                     "closures": done.get(w, 0), "closures_of_unknown_steps": unknown.get(w, 0),
                                     "busy_s": round(busy.get(w, 0.0), 3)}
                            for w, n in sorted(steps.items())},
                "in_flight": in_flight, "steps_per_closure": self.steps_per_closure, "packing": self.packing,
                "last_failure": failure, "retries": retries, "resumed_at_step": self.resumed_at_step}

    def publish(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, self.snapshot())
        except OSError:
            pass  # the view is a convenience: training goes on without it

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(PERIOD):
                self.publish()

        self._thread = threading.Thread(target=loop, daemon=True, name="dtf-figures")
        self._thread.start()

    def stop(self) -> None:
        """The last figures, once the publisher is done: a daemon thread cut by the interpreter's
        exit between its write and its rename would leave its temporary file behind."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PERIOD + 5)
        self.publish()


@dataclass
class Share:
    """One worker's part of a run: the closures it ran, the steps of those whose steps dtf knows,
    how many it does not know the steps of, and the seconds they all took."""

    host: str
    closures: int = 0
    steps: int = 0
    unknown: int = 0
    busy: float = 0.0


@dataclass
class Shares:
    """What each worker did over a `dtf train` run, as the coordinator counted it: the closures
    that completed on it (a closure retried elsewhere after its worker was lost counts where it
    completed), their steps, and the time each took from the coordinator's call to its answer
    (the round trip included: the coordinator runs one closure at a time per worker, and waits
    for it). Steps are known where fit or dtf.packing() scheduled the closure; not for a function
    the program schedules itself, nor for one of evaluate()'s shards (`unknown`). Summed over the
    program's attempts; `workers` by worker index."""

    workers: dict[int, Share] = field(default_factory=dict)
    attempts: int = 0  # the attempts that published figures

    @property
    def closures(self) -> int:
        return sum(w.closures for w in self.workers.values())

    @property
    def steps(self) -> int:
        return sum(w.steps for w in self.workers.values())

    @property
    def unknown(self) -> int:
        return sum(w.unknown for w in self.workers.values())

    def add(self, doc: dict[str, Any] | None, hosts: dict[int, str]) -> None:
        """An attempt's last train.json (None: it published none); `hosts`: each worker task's host
        now (every worker is listed, those that ran nothing too)."""
        for index, host in hosts.items():
            self.workers.setdefault(index, Share(host)).host = host
        if doc is None:
            return
        self.attempts += 1
        for key, figures in (doc.get("workers") or {}).items():
            share = self.workers.setdefault(int(key), Share(hosts.get(int(key), "?")))
            unknown = int(figures.get("closures_of_unknown_steps") or 0)
            share.closures += int(figures.get("closures") or 0)
            share.steps += int(figures.get("steps") or 0) - unknown  # (each was counted as 1 step)
            share.unknown += unknown
            share.busy += float(figures.get("busy_s") or 0.0)


_current: Figures | None = None
_making = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "off") not in ("", "off")


def current() -> Figures | None:
    """The program's figures, when `dtf train` asked for them (DTF_FIGURES)."""
    global _current
    if _current is None and enabled():
        with _making:  # the coordinator's worker threads may be first, several at once
            if _current is None:
                where = Path(os.path.expanduser(os.environ[ENV]))
                made = Figures(where / TRAIN, attempt=int(os.environ.get("DTF_ATTEMPT", "1") or 1))
                made.start()
                atexit.register(made.stop)
                _current = made
    return _current
