"""Step packing: how many training steps one closure (one round trip to a worker) runs.

Under ParameterServerStrategy each closure the coordinator schedules costs a round trip to a
worker; from a laptop to a remote cluster that is tens of milliseconds, so one step per closure
spends most of its time on the wire (each scheduled closure is one remote call:
tensorflow/python/distribute/coordinator/cluster_coordinator.py). A `Packer` measures the round
trip and a step's time on the program's own first closures, then packs enough steps into each
closure to keep that overhead under a target.

Pure (no TensorFlow): it is handed a `wait` (block until every scheduled closure finished: the
coordinator's `join`) and a clock, and yields step counts; dtf.program.hooks.packing drives tf-keras
`fit` with it, and `dtf.packing()` gives it to custom loops.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dtf.program import figures

# Overhead aimed at: round trip / (round trip + steps * step). Half of the 10% promised, as a
# margin for the noise of a measurement taken on a few closures.
TARGET_OVERHEAD = 0.05
MAX_STEPS = 1000  # the most steps in one closure: a closure is also what a lost worker repeats
PROBE_START = 4  # steps in the first multi-step probe closure
PROBE_GROWTH = 4  # the next probe runs this many times more steps
SINGLES_AFTER_WARMUP = 3  # one-step closures timed after each worker's first (tracing, registration)
PROBES_PER_SIZE = 2


@dataclass(frozen=True)
class Measurement:
    round_trip: float  # seconds a closure costs beyond its steps (the wire, scheduling, dispatch)
    step: float  # seconds one step takes on a worker


def estimate(samples: list[tuple[int, float]]) -> Measurement:
    """Round trip and step time from timed closures (steps, seconds): the fastest one-step
    closure and the fastest of the largest probe. The fastest, because a shared machine only ever
    makes a closure slower (tracing, other processes), never faster."""
    ones = [t for n, t in samples if n == 1]
    largest = max(n for n, _ in samples)
    if not ones or largest == 1:
        raise ValueError("estimate needs one-step and multi-step closures")
    t1 = min(ones)
    tm = min(t for n, t in samples if n == largest)
    step = max((tm - t1) / (largest - 1), 1e-6)
    return Measurement(round_trip=max(t1 - step, 0.0), step=step)


def choose(m: Measurement, steps_per_epoch: int | None, workers: int,
           target: float = TARGET_OVERHEAD, maximum: int = MAX_STEPS) -> int:
    """Steps per closure: enough that round_trip / (round_trip + k * step) <= target, at most
    `maximum`, and within the epoch: at most the epoch's share of one worker (a larger closure
    would leave workers idle), spread evenly (the epoch in a multiple of `workers` closures)."""
    need = math.ceil(m.round_trip * (1 - target) / (target * m.step))
    k = max(1, min(need, maximum))
    if steps_per_epoch:
        workers = max(1, workers)
        k = min(k, math.ceil(steps_per_epoch / workers))
        closures = math.ceil(steps_per_epoch / k)
        closures = math.ceil(closures / workers) * workers  # every worker gets as many
        k = max(1, math.ceil(steps_per_epoch / closures))
    return k


class Packer:
    """Step counts per closure for a training loop: `for n in packer.closures(steps): schedule a
    closure of n steps`. The first closures measure (each is waited for and timed, so they run one
    at a time); then every closure gets `chosen` steps (the last of an epoch fewer, to end the
    epoch exactly). `explicit`: the program's own value, used as it is, nothing measured."""

    def __init__(self, workers: int, wait: Callable[[], None], explicit: int | None = None,
                 say: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 maximum: int = MAX_STEPS) -> None:
        if explicit is not None and explicit < 1:
            raise ValueError(f"steps per closure must be >= 1, got {explicit}")
        self.workers, self.wait, self.say, self.clock, self.maximum = workers, wait, say, clock, maximum
        self.chosen: int | None = explicit
        self.measurement: Measurement | None = None
        self.samples: list[tuple[int, float]] = []
        self._epoch: int | None = None  # the steps_per_epoch first seen (caps probes and the choice)
        self._warm = 0  # warm-up closures scheduled (one per worker, not timed)

    @property
    def measuring(self) -> bool:
        return self.chosen is None

    def _next_probe(self) -> int | None:
        """Steps of the next measuring closure, or None when the measurement is enough."""
        singles = sum(1 for n, _ in self.samples if n == 1)
        if singles < SINGLES_AFTER_WARMUP:
            return 1
        cap = min(self.maximum, math.ceil(self._epoch / max(1, self.workers)) if self._epoch else self.maximum)
        sizes = sorted({n for n, _ in self.samples if n > 1})
        if not sizes:
            return min(PROBE_START, cap) if cap > 1 else None
        m = sizes[-1]
        if sum(1 for n, _ in self.samples if n == m) < PROBES_PER_SIZE:
            return m
        est = estimate(self.samples)
        # Enough when the probe's steps are well above the noise of a round trip, or at the cap.
        if m * est.step >= 0.5 * (est.round_trip + est.step) or m >= cap:
            return None
        return min(m * PROBE_GROWTH, cap)

    def _decide(self) -> None:
        if max(n for n, _ in self.samples) == 1:  # an epoch of no more steps than workers
            self.chosen = 1
            if self.say:
                self.say(f"packing 1 step per closure (an epoch of {self._epoch} steps over "
                         f"{self.workers} workers)")
            return
        self.measurement = estimate(self.samples)
        self.chosen = choose(self.measurement, self._epoch, self.workers, maximum=self.maximum)
        if self.say:
            self.say(f"packing {self.chosen} step{'s' if self.chosen != 1 else ''} per closure (round trip "
                     f"{self.measurement.round_trip * 1e3:.1f} ms, step {self.measurement.step * 1e3:.2f} ms)")

    def closures(self, total: int | None) -> Iterator[int]:
        """Steps of each closure, summing to `total` (an epoch; None: until the caller stops)."""
        if self._epoch is None and total:
            self._epoch = total
        done = 0
        try:
            while total is None or done < total:
                left = None if total is None else total - done
                if self.chosen is None and self._warm < max(1, self.workers):
                    # Each worker's first closure carries the function to it (and the first, its
                    # tracing): seconds, not a round trip. Scheduled together, as they would be
                    # without dtf, and waited for together; not timed.
                    self._warm += 1
                    figures.next_steps, figures.told = 1, True  # what `dtf top` shows per closure (dtf.program.figures)
                    yield 1
                    done += 1
                    if self._warm == max(1, self.workers):
                        self.wait()
                    continue
                n = self.chosen
                if n is None:
                    n = self._next_probe()
                    if n is None:
                        self._decide()
                        n = self.chosen
                assert n is not None
                if left is not None:
                    n = min(n, left)
                start = self.clock()
                measuring = self.chosen is None
                figures.next_steps, figures.told = n, True
                yield n
                if measuring:
                    self.wait()
                    self.samples.append((n, self.clock() - start))
                done += n
        finally:  # the program's next closures are its own again, unless it says
            figures.next_steps, figures.told = 1, False
