"""Fewer round trips from the coordinator: what tf-keras and TensorFlow's coordinator do one remote
call at a time, done in one call.

Under ParameterServerStrategy every eager operation the coordinator runs on a ps, and every tensor
it copies from a worker, waits for its answer before the next one starts (the coordinator's eager
context is synchronous). From a laptop far from its cluster each of those is a whole round trip,
and at every epoch end of a tf-keras `fit` the workers wait for all of them. In tf-keras 2.21 and
TensorFlow 2.21 (pinned; internals named here):

- `Model.reset_metrics` (at each epoch's start, and each `evaluate`'s) calls each metric's
  `reset_state`: `backend.batch_set_value`, one assign per variable, each sent to its ps with its
  value, one after the other.
- `Model.get_metrics_result` (at each epoch's end, through `_validate_and_get_metrics_result`,
  which reads the metrics from their variables rather than from the last closure's logs) calls
  each metric's `result()` eagerly: a read per variable, then the arithmetic, then a copy to the
  coordinator, one after the other.
- `Worker._process_closure` (tensorflow/python/distribute/coordinator/cluster_coordinator.py)
  copies the outputs of a closure whose result the program still holds (fit holds its last
  closure's logs: the loss and each metric) to the coordinator, through
  `RemoteValueImpl._copy_to_local`: one `identity` per tensor, one after the other, before the
  closure counts as done (so before `join` returns at the epoch end).

Here, under a coordinator:
- the metrics whose `reset_state` (and its old name `reset_states`) and `result` are tf-keras' own
  (compile's loss and metrics, `tf.keras.metrics` classes, and subclasses that keep those methods)
  are reset by one `tf.function`, run on their variables' ps (or from the coordinator, where they
  are spread over several ps), and their results computed by
  another, which returns them on the coordinator. tf-keras traces these same `result()` calls
  into fit's train step (`compute_metrics`). A metric with a `reset_state` or `result` of its own
  (Python that may do more than TensorFlow ops) is called as before, eagerly.
- a closure's outputs, where there are several, are copied by one `tf.function` of identities
  placed on the coordinator.

The values are the same; only the number of calls changes. Installed for every program under
`dtf train`; it acts where there is a ClusterCoordinator, in eager code (never inside a function
being traced, where tf-keras calls `get_metrics_result` itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from dtf.program.hooks import on_import

CACHE = "_dtf_roundtrips"  # on a model (set with object.__setattr__: Keras tracks its own attributes)


def install() -> None:
    on_import("tensorflow", _patch_copies)
    on_import("tf_keras", _patch_metrics)


def coordinator_device() -> str:
    """The coordinator's CPU, as TensorFlow's own copy names it (`_copy_to_local`: its job)."""
    from tensorflow.python.eager import context

    return f"/job:{context.get_server_def().job_name}/replica:0/task:0/device:CPU:0"


# ---- a closure's outputs ---------------------------------------------------------------------

def _patch_copies(_: ModuleType) -> None:
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import values
    from tensorflow.python.framework import ops
    from tensorflow.python.util import nest

    copy_to_local = values.RemoteValueImpl._copy_to_local
    # One tf.function per number of outputs, each made at its first copy (after the program
    # connected): a single variadic one would be traced again for each new number of inputs, and
    # with reduce_retracing TensorFlow 2.21 fails to relax two signatures of different lengths
    # (IndexError in FunctionType.most_specific_common_subtype: fit's outputs, then evaluate's).
    identities: dict[int, Any] = {}

    def copied(tensors: Sequence[Any]) -> list[Any]:
        if len(tensors) not in identities:
            device = coordinator_device()

            def identity_all(*inputs: Any) -> list[Any]:
                with ops.device(device):
                    return [tf.identity(t) for t in inputs]

            identities[len(tensors)] = tf.function(identity_all, reduce_retracing=True)
        result: list[Any] = identities[len(tensors)](*tensors)
        return result

    def patched_copy_to_local(self: Any) -> Any:
        flat = [] if self._values is None else nest.flatten(self._values)
        # Plain tensors only: TensorFlow's own copy leaves a DistributedIterator as it is, and
        # copies composite tensors (sparse, ragged) whole.
        if len(flat) < 2 or not all(isinstance(t, ops.EagerTensor) and t.dtype not in (tf.resource, tf.variant)
                                    for t in flat):
            return copy_to_local(self)
        return nest.pack_sequence_as(self._values, copied(flat))

    patched_copy_to_local.__wrapped__ = copy_to_local  # type: ignore[attr-defined]
    values.RemoteValueImpl._copy_to_local = patched_copy_to_local


# ---- a model's metrics -----------------------------------------------------------------------

def _tf_keras_own(cls: type, *names: str) -> bool:
    """Each method `names` of `cls` is tf-keras' own (not the program's)."""
    return all(getattr(getattr(cls, name, None), "__module__", "").startswith("tf_keras.") for name in names)


def resettable(metric: Any) -> bool:
    return _tf_keras_own(type(metric), "reset_state", "reset_states")


def computable(metric: Any) -> bool:
    return _tf_keras_own(type(metric), "result")


def _remote(model: Any) -> bool:
    import tensorflow as tf

    return getattr(model, "_cluster_coordinator", None) is not None and tf.executing_eagerly()


def _function(model: Any, kind: str, metrics: list[Any], make: Callable[[list[Any]], Any]) -> Any:
    """The model's tf.function of `kind` for these metrics (and these variables of theirs), made once."""
    cache: dict[tuple[Any, ...], Any] | None = model.__dict__.get(CACHE)
    if cache is None:
        cache = {}
        object.__setattr__(model, CACHE, cache)
    key = (kind, *((id(m), tuple(id(v) for v in m.variables)) for m in metrics))
    if key not in cache:
        cache[key] = make(metrics)
    return cache[key]


def _make_reset(metrics: list[Any]) -> Any:
    import tensorflow as tf

    def reset() -> None:
        for m in metrics:
            m.reset_state()

    return tf.function(reset)


def _make_results(metrics: list[Any]) -> Any:
    import tensorflow as tf

    device = coordinator_device()

    def results() -> list[Any]:
        out = [m.result() for m in metrics]
        with tf.device(device):  # returned here: no copy of each afterwards
            return [tf.nest.map_structure(tf.identity, r) for r in out]

    return tf.function(results)


def _patch_metrics(_: ModuleType) -> None:
    import tensorflow as tf
    from tf_keras.src.engine import training

    model_cls = training.Model
    reset_metrics, get_metrics_result = model_cls.reset_metrics, model_cls.get_metrics_result

    def patched_reset_metrics(self: Any) -> None:
        metrics = list(self.metrics) if _remote(self) else []
        ours = [m for m in metrics if resettable(m) and m.variables]
        if not ours:
            reset_metrics(self)
            return
        # One call to the ps that holds them; where they are spread over several ps, from the
        # coordinator, which runs the function's part on each at once (a ps cannot: it knows no
        # other ps, TensorFlow's device filters).
        devices = {v.device for m in ours for v in m.variables}
        with tf.device(devices.pop() if len(devices) == 1 else coordinator_device()):
            _function(self, "reset", ours, _make_reset)()
        for m in metrics:
            if not any(m is o for o in ours):
                m.reset_state()

    def patched_get_metrics_result(self: Any) -> dict[str, Any]:
        metrics = list(self.metrics) if _remote(self) else []
        ours = [m for m in metrics if computable(m) and m.variables]
        if not ours:
            return get_metrics_result(self)  # type: ignore[no-any-return]
        computed = dict(zip(map(id, ours), _function(self, "results", ours, _make_results)()))
        # As tf-keras' get_metrics_result: in the order of model.metrics, a dict result spread.
        results: dict[str, Any] = {}
        for m in metrics:
            result = computed[id(m)] if id(m) in computed else m.result()
            if isinstance(result, dict):
                results.update(result)
            else:
                results[m.name] = result
        return results

    replacements: dict[str, Callable[..., Any]] = {
        "reset_metrics": patched_reset_metrics, "get_metrics_result": patched_get_metrics_result}
    for name, function in replacements.items():
        function.__wrapped__ = getattr(model_cls, name)  # type: ignore[attr-defined]
        setattr(model_cls, name, function)
