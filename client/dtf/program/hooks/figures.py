"""Training figures for `dtf top` (dtf.program.figures), counted inside the program.

Where, in TensorFlow 2.21 and tf-keras 2.21 (pinned; internals named here):
- `cluster_coordinator.Cluster.schedule` makes one Closure per scheduled function: dtf tags it
  with the steps it will run (`figures.next_steps`, set by fit's data handler right before it schedules,
  1 for a custom loop's closure unless `dtf.packing()` said otherwise; `figures.told` says whether
  either did).
- `Closure.execute_on(worker)` returning: the closure ran on `worker.worker_index`: its steps are
  credited to that worker, and the time the call took. A worker's executor is synchronous
  (`Worker.__init__`: `executor.new_executor(enable_async=False)`), so the call returns once
  the function has run there: that time is the closure's, round trip included.
- `_CoordinatedClosureQueue`: `put_back` is a closure retried after a worker was lost,
  `mark_failed` a closure that failed; its queue size plus `inflight_closure_count` are the
  closures in flight.
- `_ClusterCoordinatorDataHandler.steps` yields once per closure, `_step_increment + 1` steps
  each (after the packing hook sets them): that is `figures.next_steps` and the steps per closure shown.

Only counters are touched on the training's threads; the file is written by the figures' own
thread (at most once a second). Active when `dtf train` sets DTF_FIGURES.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

from dtf.program import figures
from dtf.program.hooks import on_import

COORDINATOR = "tensorflow.python.distribute.coordinator.cluster_coordinator"
STEPS = "_dtf_steps"  # on a Closure: its steps, or None where dtf was not told them (counted as 1)


def install() -> None:
    if not figures.enabled():
        return
    if os.environ.get("DTF_COLLECTIVE") == "1":  # a copy on a host: no coordinator, its own steps
        on_import("tf_keras", lambda _: _patch_copy())
        return
    on_import("tensorflow", lambda _: _patch_coordinator())
    on_import("tf_keras", lambda _: _patch_keras())


def _patch_copy() -> None:
    """Collective mode: each call of fit's train function is one execution of
    `steps_per_execution` steps on this copy (its worker index from TF_CONFIG)."""
    import json

    from tf_keras.src.engine import training

    model_cls = training.Model
    make_train_function = model_cls.make_train_function
    try:
        index = int(json.loads(os.environ.get("TF_CONFIG", "{}"))["task"]["index"])
    except (KeyError, TypeError, ValueError):
        index = 0

    def patched_make_train_function(self: Any, force: bool = False) -> Any:
        function = make_train_function(self, force)
        if function is None or getattr(function, "_dtf_counted", False):
            return function
        steps = int(self._steps_per_execution.numpy()) if self._steps_per_execution is not None else 1

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            f = figures.current()
            if f is not None:
                f.closure_done(index, steps)
            return result

        counted._dtf_counted = True  # type: ignore[attr-defined]
        f = figures.current()
        if f is not None:
            f.steps_per_closure, f.packing = steps, "program"
        self.train_function = counted
        return counted

    patched_make_train_function.__wrapped__ = make_train_function  # type: ignore[attr-defined]
    model_cls.make_train_function = patched_make_train_function


def _patch_coordinator() -> None:
    import importlib

    module = importlib.import_module(COORDINATOR)
    cluster_cls, closure_cls, queue_cls = module.Cluster, module.Closure, module._CoordinatedClosureQueue
    schedule, execute_on, init = cluster_cls.schedule, closure_cls.execute_on, closure_cls.__init__
    resource_cls = module.ResourceClosure
    put_back, mark_failed = queue_cls.put_back, queue_cls.mark_failed

    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        setattr(self, STEPS, figures.next_steps if figures.told else None)

    def patched_schedule(self: Any, function: Any, args: Any, kwargs: Any) -> Any:
        f = figures.current()
        if f is not None:
            if getattr(f.in_flight, "queue", lambda: None)() is not self.closure_queue:  # a new coordinator
                queue = weakref.ref(self.closure_queue)

                def in_flight() -> int | None:
                    q = queue()
                    return None if q is None else int(q._queue.qsize()) + int(q.inflight_closure_count)

                in_flight.queue = queue  # type: ignore[attr-defined]
                f.in_flight = in_flight
            f.steps_per_closure = figures.next_steps
        return schedule(self, function, args, kwargs)

    def patched_execute_on(self: Any, worker: Any) -> Any:
        start = time.monotonic()
        result = execute_on(self, worker)
        f = figures.current()
        if f is not None and not isinstance(self, resource_cls):
            steps = getattr(self, STEPS, None)
            f.closure_done(int(worker.worker_index), int(steps or 1), time.monotonic() - start, told=steps is not None)
        return result

    def patched_put_back(self: Any, closure: Any) -> Any:
        f = figures.current()
        if f is not None:
            f.failed("a worker was lost: its closure is retried on another", retried=True)
        return put_back(self, closure)

    def patched_mark_failed(self: Any, e: BaseException) -> Any:
        f = figures.current()
        if f is not None:
            f.failed(f"closure failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", retried=False)
        return mark_failed(self, e)

    closure_cls.__init__ = patched_init
    cluster_cls.schedule = patched_schedule
    closure_cls.execute_on = patched_execute_on
    queue_cls.put_back = patched_put_back
    queue_cls.mark_failed = patched_mark_failed


def _patch_keras() -> None:
    from tf_keras.src.engine import data_adapter

    handler_cls = data_adapter._ClusterCoordinatorDataHandler
    steps = handler_cls.steps

    def patched_steps(self: Any) -> Iterator[int]:
        try:
            for step in steps(self):
                figures.next_steps, figures.told = int(self._step_increment) + 1, True
                f = figures.current()
                if f is not None:
                    packed = self._model is not None and self._model.__dict__.get("_dtf_packing") is not None
                    f.packing = "dtf" if packed else "program"
                yield step
        finally:
            figures.next_steps, figures.told = 1, False

    handler_cls.steps = patched_steps

    # Where fit resumes from a backup (BackupAndRestore, dtf's included: it restores in
    # on_train_begin, the optimizer's iterations with the model): the step it resumes at.
    from tf_keras.src.callbacks import BackupAndRestore

    on_train_begin = BackupAndRestore.on_train_begin

    def patched_on_train_begin(self: Any, logs: Any = None) -> Any:
        result = on_train_begin(self, logs)
        f = figures.current()
        optimizer = getattr(self.model, "optimizer", None)
        if f is not None and optimizer is not None:
            try:
                step = int(optimizer.iterations.numpy())
            except Exception:  # no step to read: nothing to say
                step = 0
            if step > 0:
                f.resumed_at_step = step
        return result

    BackupAndRestore.on_train_begin = patched_on_train_begin
