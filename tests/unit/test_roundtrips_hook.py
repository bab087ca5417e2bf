"""Which metrics dtf.program.hooks.roundtrips batches, and the function the packing hook takes from
tf-keras' scheduling lambda, on stand-ins (no TensorFlow here: the real ones are exercised end to
end in tests/e2e/test_roundtrips.py)."""

from __future__ import annotations

from typing import Any

from dtf.program.hooks import packing, roundtrips


class Metric:  # methods that say they are tf-keras' own, as tf_keras.src.metrics.base_metric.Metric's do
    def reset_state(self) -> None: ...
    def reset_states(self) -> None: ...
    def result(self) -> None: ...


for _name in ("reset_state", "reset_states", "result"):
    getattr(Metric, _name).__module__ = "tf_keras.src.metrics.base_metric"


class Mean(Metric):  # a subclass that keeps them (a program's metric that only updates its own way)
    def update_state(self) -> None: ...


class OwnResult(Metric):
    def result(self) -> None: ...


class OldReset(Metric):  # the old name: tf-keras' reset_state calls it
    def reset_states(self) -> None: ...


def test_only_tf_keras_own_methods_are_batched() -> None:
    assert roundtrips.resettable(Mean()) and roundtrips.computable(Mean())
    assert roundtrips.resettable(OwnResult()) and not roundtrips.computable(OwnResult())
    assert not roundtrips.resettable(OldReset()) and roundtrips.computable(OldReset())
    assert not roundtrips.resettable(object()) and not roundtrips.computable(object())


def keras_lambda(model: Any, train_function: Any) -> Any:
    """tf-keras 2.21's Model.make_train_function, multi-step, under a coordinator."""
    self = model
    return lambda it: self._cluster_coordinator.schedule(train_function, args=(it, self._steps_per_execution.value()))


def test_the_scheduled_function_is_taken_from_tf_keras_lambda_only() -> None:
    def function(iterator: Any, steps: Any) -> None: ...

    assert packing._scheduled_function(keras_lambda(object(), function)) is function
    assert packing._scheduled_function(function) is None  # not a lambda of one argument
    assert packing._scheduled_function(lambda it: function(it, 1)) is None  # not tf-keras' lambda
    assert packing._scheduled_function(object()) is None
