"""A worker whose function was cut off mid-step gets its datasets rebuilt, as after a lost worker.

TensorFlow's ClusterCoordinator (tensorflow/python/distribute/coordinator/cluster_coordinator.py)
treats an error that names a ps (`Connection reset by peer` from `/job:ps`, on a worker whose link
came back after a cut) as transient: it runs the same function again on the same worker, with the
same iterator. But that function was cancelled inside the dataset's GetNext, and a tf.data iterator
cancelled there stays broken: every later GetNext reports `End of sequence`, even on a
`.repeat()`ed dataset. The coordinator then takes that for the data's end and the program dies of
an OutOfRangeError (a worker host cut off for a while, then back). On a worker it counts as lost,
the coordinator rebuilds every per-worker resource (datasets, iterators) before the next function;
after a transient failure it does not.

So, per worker: after a transient failure, an OutOfRangeError from the next function that runs
there is taken for that broken iterator, once. dtf says so, rebuilds the worker's resources
exactly as the coordinator does on a worker's recovery, and puts the function back in the queue.
A second OutOfRangeError (a finite dataset that really ended) reaches the program as before; so
does one with no transient failure just before it (a function that ran fine in between shows the
iterator was not broken).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dtf.program.hooks import on_import

_lock = threading.Lock()
_suspect: set[str] = set()  # workers (device names) whose function was cut off since their last rebuild
_rebuilding: set[str] = set()  # workers whose function is being put back by dtf itself


def install() -> None:
    on_import("tensorflow", _patch)


def _patch(tf: ModuleType) -> None:
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    for handler in (cc.WorkerPreemptionHandler, cc.CoordinationServicePreemptionHandler):
        handler.wait_on_failure = _noting_transient_failures(handler.wait_on_failure)
    cc.Worker._on_worker_recovery = _forgetting_on_recovery(cc.Worker._on_worker_recovery)
    from tensorflow.python.framework import errors

    cc.Closure.execute_on = _rebuilding_broken_iterators(cc.Closure.execute_on, cc.ResourceClosure,
                                                         errors.OutOfRangeError, errors.CancelledError)


def _noting_transient_failures(wait_on_failure: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, on_failure_fn: Callable[..., Any] | None = None,
                on_transient_failure_fn: Callable[[], Any] | None = None,
                on_recovery_fn: Callable[[], Any] | None = None,
                worker_device_name: str = "(unknown)") -> Any:
        def transient() -> None:
            with _lock:
                if worker_device_name in _rebuilding:
                    _rebuilding.discard(worker_device_name)  # dtf's own put-back, below
                else:
                    _suspect.add(worker_device_name)
            if on_transient_failure_fn:
                on_transient_failure_fn()

        return wait_on_failure(self, on_failure_fn=on_failure_fn, on_transient_failure_fn=transient,
                               on_recovery_fn=on_recovery_fn, worker_device_name=worker_device_name)

    return wrapper


def _forgetting_on_recovery(on_recovery: Callable[[Any], None]) -> Callable[[Any], None]:
    def wrapper(self: Any) -> None:
        with _lock:
            _suspect.discard(self.device_name)  # its resources are built again: nothing broken left
        on_recovery(self)

    return wrapper


def _rebuilding_broken_iterators(execute_on: Callable[[Any, Any], None], resource_closure: type,
                                 out_of_range: type[Exception], cancelled: Callable[..., Exception]
                                 ) -> Callable[[Any, Any], None]:
    def wrapper(self: Any, worker: Any) -> None:
        try:
            execute_on(self, worker)
            if not isinstance(self, resource_closure):
                with _lock:
                    _suspect.discard(worker.device_name)  # its iterators read: none broken
        except out_of_range:
            name = worker.device_name
            with _lock:
                broken = name in _suspect and not isinstance(self, resource_closure)
                if broken:
                    _suspect.discard(name)
                    _rebuilding.add(name)
            if not broken:
                raise
            task = name.replace("/job:", "").replace("/replica:0/task:", ":")
            print(f"dtf: {task}'s dataset iterator ended after its connection failed mid-step: "
                  "rebuilding its datasets and running the function again", file=sys.stderr, flush=True)
            worker._on_worker_recovery()  # the coordinator's own rebuild, queued before the function
            # A derived cancellation (it names a /job:) is what the coordinator puts back in the
            # queue without counting a failure: the function then runs with the new iterator.
            raise cancelled(None, None, f"dtf: {name} had a broken iterator; rebuilt") from None

    return wrapper
