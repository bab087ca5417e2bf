"""dtf.program.hooks.recovery: after a transient failure, one OutOfRangeError rebuilds the worker's
resources and runs the function again. TensorFlow's coordinator is played by fakes that follow its
code (cluster_coordinator.py, TF 2.21): the lab test is tests/e2e/test_survival.py, a worker host
cut off for 20 s."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dtf.program.hooks import recovery


class OutOfRange(Exception):
    pass


class Cancelled(Exception):
    def __init__(self, node_def: object, op: object, message: str) -> None:
        super().__init__(message)


class PsReset(Exception):
    """An UnavailableError naming /job:ps: the coordinator's transient failure."""


class Handler:
    """WorkerPreemptionHandler.wait_on_failure, its transient branches."""

    @contextlib.contextmanager
    def wait_on_failure(self, on_failure_fn: Any = None, on_transient_failure_fn: Any = None,
                        on_recovery_fn: Any = None, worker_device_name: str = "(unknown)") -> Iterator[None]:
        try:
            yield
        except (PsReset, Cancelled) as e:
            if isinstance(e, Cancelled) and "/job:" not in str(e):
                raise
            if on_transient_failure_fn:
                on_transient_failure_fn()


class Worker:
    def __init__(self, index: int) -> None:
        self.device_name = f"/job:worker/replica:0/task:{index}"
        self.rebuilds = 0

    def _on_worker_recovery(self) -> None:
        self.rebuilds += 1


class Closure:
    def __init__(self, *outcomes: type[Exception] | None) -> None:
        self.outcomes = list(outcomes)  # what each run does: raise this, or (None) succeed

    def execute_on(self, worker: Worker) -> None:
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome("end of sequence" if outcome is OutOfRange else "reset by /job:ps")


class ResourceClosure(Closure):
    pass


@pytest.fixture
def coordinator() -> Iterator[Callable[[Worker, Closure], list[str]]]:
    """Runs a closure on a worker as Worker._process_closure does, until it ends: what happened."""
    recovery._suspect.clear()
    recovery._rebuilding.clear()
    handler = Handler()
    wait_on_failure = recovery._noting_transient_failures(Handler.wait_on_failure.__wrapped__)  # type: ignore[attr-defined]
    wait = contextlib.contextmanager(wait_on_failure)
    Worker._on_worker_recovery = recovery._forgetting_on_recovery(Worker._on_worker_recovery)  # type: ignore[method-assign]
    execute_on = recovery._rebuilding_broken_iterators(Closure.execute_on, ResourceClosure, OutOfRange, Cancelled)

    def run(worker: Worker, closure: Closure) -> list[str]:
        seen = []
        queue: list[Closure] = []  # the closures put back
        while closure.outcomes:
            queue.clear()
            try:
                with wait(handler, on_transient_failure_fn=lambda: queue.append(closure),
                          worker_device_name=worker.device_name):
                    execute_on(closure, worker)
                    seen.append("done")
            except OutOfRange:
                seen.append("OutOfRange reached the program")
                break
            if queue:
                seen.append("put back")
        return seen

    original = Worker._on_worker_recovery
    yield run
    Worker._on_worker_recovery = original  # type: ignore[method-assign]


def test_after_a_transient_failure_an_iterator_that_ended_is_rebuilt_once(coordinator, capsys):
    w = Worker(1)
    assert coordinator(w, Closure(PsReset, OutOfRange, None)) == ["put back", "put back", "done"]
    assert w.rebuilds == 1
    assert capsys.readouterr().err == ("dtf: worker:1's dataset iterator ended after its connection failed "
                                       "mid-step: rebuilding its datasets and running the function again\n")
    # A second end, with no failure in between, is the data's real end.
    assert coordinator(w, Closure(OutOfRange)) == ["OutOfRange reached the program"]
    assert w.rebuilds == 1


def test_a_finite_dataset_that_ends_after_the_rebuild_still_ends(coordinator):
    w = Worker(0)
    assert coordinator(w, Closure(PsReset, OutOfRange, OutOfRange)) == [
        "put back", "put back", "OutOfRange reached the program"]
    assert w.rebuilds == 1


def test_without_a_transient_failure_the_end_of_the_data_reaches_the_program(coordinator):
    w = Worker(0)
    assert coordinator(w, Closure(OutOfRange)) == ["OutOfRange reached the program"]
    assert w.rebuilds == 0


def test_only_the_worker_that_failed_is_suspect(coordinator):
    w0, w1 = Worker(0), Worker(1)
    assert coordinator(w1, Closure(PsReset)) == ["put back"]
    assert coordinator(w0, Closure(OutOfRange)) == ["OutOfRange reached the program"]
    assert coordinator(w1, Closure(OutOfRange, None)) == ["put back", "done"]
    assert (w0.rebuilds, w1.rebuilds) == (0, 1)


def test_a_worker_recovered_by_the_coordinator_has_new_iterators_already(coordinator):
    w = Worker(0)
    assert coordinator(w, Closure(PsReset)) == ["put back"]
    w._on_worker_recovery()  # the coordinator's own rebuild, after a worker failure
    assert coordinator(w, Closure(OutOfRange)) == ["OutOfRange reached the program"]
    assert w.rebuilds == 1


def test_a_resource_closure_is_never_retried_this_way(coordinator):
    w = Worker(0)
    assert coordinator(w, ResourceClosure(PsReset, OutOfRange)) == ["put back", "OutOfRange reached the program"]
    assert w.rebuilds == 0


def test_a_function_that_ran_fine_after_the_failure_shows_the_iterator_was_not_broken(coordinator):
    w = Worker(0)
    assert coordinator(w, Closure(PsReset, None)) == ["put back", "done"]
    assert coordinator(w, Closure(OutOfRange)) == ["OutOfRange reached the program"]
    assert w.rebuilds == 0
