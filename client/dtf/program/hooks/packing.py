"""Automatic step packing for tf-keras `fit` under ParameterServerStrategy.

A program that does not choose `steps_per_execution` (or passes `"auto"`) runs one step per
closure: one round trip to a worker per step. tf-keras' own "auto" tuner stayed at 1 under this
strategy (tf_keras/src/utils/steps_per_execution_tuning.py). Here dtf measures the round trip and a
step's time on fit's first closures and packs steps (dtf.program.packer.Packer), printing what it
chose. A `steps_per_execution` the program sets (in `compile`, or the `model.steps_per_execution`
setter) is used as it is.

How, in tf-keras 2.21 (pinned; internals named below):
- `Model.make_train_function` builds, under a coordinator, a function taking the step count as an
  argument, read from `model._steps_per_execution` (a variable) when each closure is scheduled;
  but only when that variable is not 1 at build time (else a one-step function): dtf has it
  build the multi-step one. The variable lives on a ps: that read is a round trip for every
  closure, made before the closure is handed to a worker. dtf schedules that same multi-step
  function itself (taken from tf-keras' scheduling lambda: `train_function`), with the count it
  chose as a tensor on the coordinator, sent along with the closure: no read, and the variable
  keeps the program's value. Where the lambda is not as expected, dtf sets the variable before
  each closure whose count differs from the last, and tf-keras reads it.
- `_ClusterCoordinatorDataHandler.steps` yields one fit iteration per closure and advances the
  step by the variable's value: dtf replaces it, for a packed fit, with one that takes the
  Packer's count for each closure.
- `evaluate` (also inside fit, for validation) sees the program's own value.

Off with `dtf train --no-packing` (DTF_PACKING=off).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dtf.program import hooks
from dtf.program.packer import Packer

ENV = "DTF_PACKING"
STATE = "_dtf_packing"  # attribute on a model (set with object.__setattr__: Keras tracks its own)
CHOSEN = "_dtf_steps_per_execution"  # what the program passed to compile


@dataclass
class State:
    packer: Packer
    original: int  # the variable's value as the program left it (1)
    held: int  # what the variable holds now, as far as dtf knows
    active: bool = False  # inside fit, outside its evaluate
    train_function: Any = field(default=None)
    direct: bool = False  # train_function schedules with `count` (else tf-keras reads the variable)
    count: int = 1  # the steps of the next closure
    counts: dict[int, Any] = field(default_factory=dict)  # count -> its tensor on the coordinator


def say(message: str) -> None:
    print(f"dtf: {message}", file=sys.stderr, flush=True)


def enabled() -> bool:
    return os.environ.get(ENV, "auto") != "off"


def install() -> None:
    if enabled():
        hooks.on_import("tf_keras", _patch)


def _state(model: Any) -> State | None:
    state: State | None = model.__dict__.get(STATE)
    return state


def _explicit(value: Any) -> bool:
    return value is not None and value != "auto"


def _prepare(model: Any) -> State | None:
    """The packing state for this fit, or None where dtf leaves it to tf-keras."""
    strategy = model.distribute_strategy
    if not getattr(strategy, "_should_use_with_coordinator", False) or model._steps_per_execution is None:
        return None
    if _explicit(model.__dict__.get(CHOSEN)) or model.run_eagerly:
        return None
    state = _state(model)
    if state is None:
        value = int(model._steps_per_execution.numpy())
        if value != 1:  # set through the model.steps_per_execution setter: the program's choice
            return None
        packer = Packer(workers=int(strategy._num_workers), wait=lambda: model._cluster_coordinator.join(), say=say)
        state = State(packer=packer, original=value, held=value)
        object.__setattr__(model, STATE, state)
    return state


def _patch(_: ModuleType) -> None:
    from tf_keras.src.engine import data_adapter, training

    model_cls = training.Model
    handler_cls = data_adapter._ClusterCoordinatorDataHandler
    compile_, fit, evaluate = model_cls.compile, model_cls.fit, model_cls.evaluate
    make_train_function, steps = model_cls.make_train_function, handler_cls.steps
    compile_signature = inspect.signature(compile_)

    def patched_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = compile_signature.bind(self, *args, **kwargs).arguments
        chosen = bound.get("steps_per_execution") or bound.get("kwargs", {}).get("experimental_steps_per_execution")
        result = compile_(self, *args, **kwargs)
        object.__setattr__(self, CHOSEN, chosen)
        self.__dict__.pop(STATE, None)  # another compile: another model to measure
        return result

    def patched_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _prepare(self)
        if state is None:
            return fit(self, *args, **kwargs)
        # "auto": dtf chooses; tf-keras' tuner thread would change the variable under it.
        autotune = self._autotune_steps_per_execution
        self._autotune_steps_per_execution = False
        state.active = True
        ended = False  # fit returned (not interrupted, not failed)
        try:
            history = fit(self, *args, **kwargs)
            ended = True
            return history
        finally:
            state.active = False
            self._autotune_steps_per_execution = autotune
            _hold(self, state, state.original)
            if ended and state.packer.measuring and state.packer.samples:  # a fit too short to finish measuring
                largest = max(n for n, _ in state.packer.samples)
                say(f"packing: fit ended while dtf was still measuring (its closures ran at most {largest} step(s)); "
                    f"the next fit of this model goes on measuring")

    def patched_evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state is None or not state.active:
            return evaluate(self, *args, **kwargs)
        state.active = False  # validation inside fit: the program's own steps per execution
        _hold(self, state, state.original)
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            state.active = True

    def patched_make_train_function(self: Any, force: bool = False) -> Any:
        state = _state(self)
        if state is None or not state.active or not self._cluster_coordinator:
            return make_train_function(self, force)
        if self.train_function is not None and not force and self.train_function is state.train_function:
            return self.train_function
        # tf-keras builds a one-step function when the variable is 1 and it is not autotuning;
        # the multi-step one reads the count when each closure is scheduled.
        autotune = self._autotune_steps_per_execution
        self._autotune_steps_per_execution = True
        try:
            scheduling = make_train_function(self, True)
        finally:
            self._autotune_steps_per_execution = autotune
        function = _scheduled_function(scheduling)
        state.direct = function is not None
        if function is None:
            state.train_function = scheduling
        else:
            coordinator = self._cluster_coordinator
            dtype = self._steps_per_execution.dtype

            def train_function(iterator: Any) -> Any:
                return coordinator.schedule(function, args=(iterator, _count(state, dtype)))

            state.train_function = self.train_function = train_function
        return state.train_function

    def patched_steps(self: Any) -> Iterator[int]:
        model = self._model
        state = _state(model) if model is not None else None
        if state is None or not state.active or self._steps_per_execution is not model._steps_per_execution:
            yield from steps(self)
            return
        # As tf-keras' steps(), with the step count of each closure from the Packer.
        self._current_step, self._initial_step = self._initial_step, 0
        total = None if self._inferred_steps is None else self._inferred_steps - self._current_step
        for n in state.packer.closures(total):
            if self._insufficient_data:  # set by catch_stop_iteration
                break
            if state.direct:
                state.count = n
            else:
                _hold(model, state, n)
            self._step_increment = n - 1
            yield self._current_step
            self._current_step += n

    replacements: dict[str, Callable[..., Any]] = {
        "compile": patched_compile, "fit": patched_fit, "evaluate": patched_evaluate,
        "make_train_function": patched_make_train_function}
    for name, function in replacements.items():
        function.__wrapped__ = getattr(model_cls, name)  # type: ignore[attr-defined]
        setattr(model_cls, name, function)
    handler_cls.steps = patched_steps


def _hold(model: Any, state: State, value: int) -> None:
    """Set the model's steps_per_execution variable (a write to a ps: only when it changes)."""
    if state.held != value:
        model._steps_per_execution.assign(value)
        state.held = value


def _scheduled_function(scheduling: Any) -> Any:
    """The multi-step tf.function that tf-keras' lambda `lambda it: self._cluster_coordinator.schedule(
    train_function, args=(it, self._steps_per_execution.value()))` schedules, or None where the
    lambda is not that one."""
    code = getattr(scheduling, "__code__", None)
    if code is None or code.co_argcount != 1 or not {"schedule", "_steps_per_execution"} <= set(code.co_names):
        return None
    cells = dict(zip(code.co_freevars, scheduling.__closure__ or ()))
    cell = cells.get("train_function")
    function = cell.cell_contents if cell is not None else None
    return function if callable(function) else None


def _count(state: State, dtype: Any) -> Any:
    """The next closure's step count, as a tensor on the coordinator (made once per count)."""
    n = state.count
    if n not in state.counts:
        import tensorflow as tf

        from dtf.program.hooks.roundtrips import coordinator_device

        with tf.device(coordinator_device()):
            state.counts[n] = tf.constant(n, dtype=dtype)
    return state.counts[n]
