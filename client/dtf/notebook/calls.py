"""The coordinator calls of a connected process (dtf.connect()), guarded: when the cluster went away
under one (`dtf down`, a lost ps) it ends with one clear error (connection.ClusterGone) rather than
TensorFlow's, or a wait for workers that will not come back.

ClusterCoordinator's `schedule`, `join`, `done`, `fetch` and `create_per_worker_dataset`
(tensorflow/python/distribute/coordinator/cluster_coordinator.py) are where a program waits on the
cluster (tf-keras' `fit` and `evaluate` call them too). A call on the main thread is counted while it
runs: the connection's watch interrupts it (SIGINT to the main thread) when `dtf down` begins. A
TensorFlow error or that interrupt is then explained by the connection (`Connection.explain`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from dtf.program.hooks import on_import

METHODS = ("schedule", "join", "done", "fetch", "create_per_worker_dataset")


class Attached(Protocol):
    """What the calls need of the connection (connection.Connection)."""

    main_thread: threading.Thread
    calls: int

    def _usable(self) -> None: ...

    def explain(self, error: BaseException) -> BaseException | None: ...


_connection: Attached | None = None


def install(connection: Attached) -> None:
    global _connection
    first = _connection is None
    _connection = connection
    if first:
        on_import("tensorflow", _patch)


def _patch(_: ModuleType) -> None:
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    cls = cluster_coordinator.ClusterCoordinator
    for name in METHODS:
        setattr(cls, name, guarded(getattr(cls, name)))


def _tf_error(error: BaseException) -> bool:
    return isinstance(error, KeyboardInterrupt) or type(error).__module__.startswith("tensorflow")


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        c = _connection
        if c is None or threading.current_thread() is not c.main_thread:
            return method(*args, **kwargs)
        c._usable()
        c.calls += 1
        try:
            return method(*args, **kwargs)
        except BaseException as e:
            if not _tf_error(e):
                raise
            better = c.explain(e)
            if better is None:
                raise
            raise better from None
        finally:
            c.calls -= 1

    return call
