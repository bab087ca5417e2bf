"""The training figures `dtf top` shows, published by the program's hooks (and by `dtf train`
itself) as small JSON files in the laptop's `$DTF_HOME/live/CLUSTER/`:

    train.json   the program's (ParameterServerStrategy): steps and steps/s overall and per
                 worker, closures in flight, steps per closure, the last failure or retry
    run.json     `dtf train`'s: the attempt, its limit, the last lost ps it retried after; in
                 collective mode the copies (state, joined, attempt)

Each is rewritten at most once a second, by a daemon thread, never by the training's own
threads, and atomically (written beside, then renamed): a reader never sees half of one. The
training's threads only add to counters (`Figures.closure_done`), a lock and two additions.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtf_server import layout

ENV = "DTF_FIGURES"  # the directory: set by `dtf train` for the program ("off": publish nothing)
TRAIN = layout.TRAIN  # "train.json"
RUN = "run.json"
PERIOD = 1.0  # seconds between two writes, at most one write per period
SCHEMA = 1

next_steps = 1  # the steps of the next closure the program schedules (fit's data handler, dtf.packing())


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
        self.closures = 0
        self.steps_per_closure: int | None = None
        self.packing: str | None = None  # how the steps per closure were chosen
        self.last_failure: str | None = None
        self.retries = 0
        self.in_flight: Callable[[], int | None] = lambda: None
        self._previous: tuple[float, dict[int, int]] | None = None
        self._rates: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.time()

    def closure_done(self, worker: int, steps: int) -> None:
        with self.lock:
            self.steps[worker] = self.steps.get(worker, 0) + steps
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
            steps = dict(self.steps)
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
                "workers": {str(w): {"steps": n, "steps_per_s": round(self._rates.get(w, 0.0), 2)}
                            for w, n in sorted(steps.items())},
                "in_flight": in_flight, "steps_per_closure": self.steps_per_closure, "packing": self.packing,
                "last_failure": failure, "retries": retries}

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
