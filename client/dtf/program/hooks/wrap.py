"""`dtf train --wrap`: a single-machine tf-keras program, with no strategy code, trains on the cluster.

What it changes (each change is named in one line, `dtf: --wrap: ...`, at the first fit or
evaluate):
- The cluster: the program is connected to it (as the strategy connects it: job `chief`, the
  strategy's device filters) when TensorFlow's runtime starts, at the program's first op, not
  when the strategy is made. A program builds its datasets, tensors and variables wherever it
  likes (the tutorial: datasets first, then the model, then fit and evaluate): made under the
  local job, they would name a device (`/job:localhost/...`) that no longer exists once the
  strategy connects (`unknown device`). `tf.config` calls made before the first op still act, as
  on one machine: the connection is set up at the moment the runtime starts, with the
  configuration as it then is. The strategy's own connection then finds the same cluster and only
  updates it (TensorFlow's `connect_to_cluster`: same cluster, job and task: no reset).
- The strategy: before the program makes its first Keras layer or model, dtf makes the
  ParameterServerStrategy of the cluster (`dtf.strategy()`) and enters its scope for the rest of
  the program, so the model, its optimizer and metrics are built and compiled in it (their
  variables live on the ps), wherever the program builds them (module level, a function).
- `fit` on a finite `tf.data.Dataset` without `steps_per_epoch` (which this strategy requires,
  and where each worker reads the whole dataset): the dataset repeats and `steps_per_epoch` is
  its length, so an epoch is as many batches as on one machine. Where the length cannot be known
  (a dataset that repeats forever, or of unknown length), one line says what to pass. On arrays,
  `steps_per_epoch` counts the training examples (after `validation_split`, made here as fit
  makes it).
- `evaluate`, and fit's validation in every form (`validation_split`, arrays, a dataset of any
  size), run on the coordinator (this program), as tf-keras' own `predict` does under this
  strategy. On the workers, evaluate fails on a finite dataset (every worker reads all of it and
  runs off its end: OutOfRangeError), arrays need `validation_steps`, and exact evaluation
  (`pss_evaluation_shards`) cannot shard a dataset of fewer batches than shards ("Could not apply
  FILE based sharding"; tf_keras/src/engine/training.py, `shard_test_function`).
- `verbose=1` (a progress bar per batch, refused under this strategy) becomes 2 (a line per epoch).

A program that makes a ParameterServerStrategy of its own before its first layer is left alone;
any other strategy of its own would train on this machine, and dtf.program.hooks.oncluster refuses it
when it is made.

A model built under `dtf.strategy()` (without --wrap: under `dtf train`, in a notebook, or run with
plain `python`) gets the part of this that concerns arrays, which tf-keras under this strategy
takes only with step counts and trains on the workers (`adapt_fit`, called when dtf.strategy() makes
the strategy): `fit` on arrays without `steps_per_epoch` counts an epoch from their length and
`batch_size`, `validation_split` is made here, validation on arrays (from the split, or
`validation_data=(x, y)` without `validation_steps`) and `evaluate`/`predict` on arrays run here, on
the coordinator, every example once. Datasets are left as tf-keras takes them (a dataset's files
may be on the workers only); a dict or list of arrays, which tf-keras does not take under this
strategy, is refused in one line. Each change is said once (`dtf: fit: ...`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from dtf.program import hooks

ENV = "DTF_WRAP"


class WrapError(SystemExit):
    """What --wrap cannot supply: one line, exit code 2, no traceback (raised in the program)."""

    def __init__(self, message: str) -> None:
        print(f"dtf: error: --wrap: {message}", file=sys.stderr, flush=True)
        super().__init__(2)


class _Wrap:
    """What --wrap did so far, and what it has reported."""

    def __init__(self) -> None:
        self.strategy: Any = None
        self.scope: Any = None  # entered for the rest of the program: keep it
        self.foreign: str | None = None  # the program's own strategy, if it made one
        self.changes: list[str] = []
        self.reported = 0

    def enter(self) -> None:
        """Make the strategy and enter its scope, once, before the first layer."""
        if self.strategy is not None or self.foreign is not None:
            return
        import tensorflow as tf

        import dtf

        if tf.distribute.has_strategy():
            self.foreign = type(tf.distribute.get_strategy()).__name__
            if self.foreign != "ParameterServerStrategyV2":
                say(f"--wrap: the program uses a strategy of its own ({self.foreign}): --wrap changes nothing")
            return
        self.strategy = dtf.strategy()
        self.scope = self.strategy.scope()
        self.scope.__enter__()
        self.changes.append(f"made a ParameterServerStrategy ({self.strategy._num_workers} workers, "
                            f"{self.strategy._num_ps} ps) and built the model in its scope")
        self.changes.append("evaluate and predict run here, on the coordinator (as tf-keras' predict does "
                            "on a dataset)")

    @contextlib.contextmanager
    def on_coordinator(self, model: Any) -> Iterator[None]:
        """Run the model here, as tf-keras' own predict does under this strategy: out of the
        strategy's scope, with no strategy or coordinator on the model (its variables stay on the
        ps and are read from there)."""
        assert self.scope is not None
        saved = (model._distribution_strategy, model._cluster_coordinator, model.test_function,
                 model.predict_function, model._pss_evaluation_shards)
        self.scope.__exit__(None, None, None)
        model._distribution_strategy = model._cluster_coordinator = None
        model.test_function = model.predict_function = None  # traced for the strategy: traced again here
        model._pss_evaluation_shards = 0  # every example once, here: no shards to put together
        try:
            yield
        finally:
            (model._distribution_strategy, model._cluster_coordinator, model.test_function,
             model.predict_function, model._pss_evaluation_shards) = saved
            self.scope = self.strategy.scope()
            self.scope.__enter__()

    def change(self, what: str) -> None:
        if what not in self.changes:
            self.changes.append(what)

    def report(self, prefix: str = "--wrap: ") -> None:
        """One line with every change not yet reported."""
        if len(self.changes) > self.reported:
            say(prefix + "; ".join(self.changes[self.reported:]))
            self.reported = len(self.changes)


def say(message: str) -> None:
    print(f"dtf: {message}", file=sys.stderr, flush=True)


_wrap = _Wrap()
_arrays = _Wrap()  # what fit on arrays changed for models of dtf.strategy() (no --wrap): `dtf: fit: ...`
_patched = False


def install() -> None:
    if os.environ.get(ENV) == "1":
        if os.environ.get("TF_CONFIG"):  # under `dtf train`: the cluster is known before any op
            hooks.on_import("tensorflow", _connect_at_start)
        hooks.on_import("tf_keras", _patch)


def adapt_fit() -> None:
    """Arrays in fit, evaluate and predict for the models of dtf.strategy() (see the module's
    docstring): tf-keras patched now, or when the program imports it."""
    hooks.on_import("tf_keras", _patch)


def _connect_at_start(_: ModuleType) -> None:
    """Connect the program to the cluster when TensorFlow's runtime starts (the program's first
    op, or the strategy's own start), before anything is made under the local job."""
    from tensorflow.python.distribute import parameter_server_strategy_v2 as pss
    from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver
    from tensorflow.python.eager import context

    start = context.Context.ensure_initialized
    busy = False

    def ensure_initialized(self: Any) -> None:
        nonlocal busy
        # Only TensorFlow's global context, once, and not where the program asked for collective
        # ops (remote execution and collective ops cannot both be set).
        if (self._initialized or busy or self is not context.context()
                or self._collective_ops_server_def is not None or self._server_def is not None):
            start(self)
            return
        busy = True
        try:
            # The strategy's own connection (the same cluster, job, task and device filters, so
            # that its later call changes nothing); it ends by starting the runtime (this method,
            # again: `busy`). Its coordination service, when asked for, is configured first, as
            # the strategy's constructor does.
            stand_in = _Connection(TFConfigClusterResolver())
            if os.getenv("TF_PSS_ENABLE_COORDINATION_SERVICE"):
                pss.ParameterServerStrategyV2._configure_coordination_service(
                    stand_in, stand_in._cluster_resolver.cluster_spec())
            pss.ParameterServerStrategyV2._connect_to_cluster(stand_in, coordinator_name="chief")
        finally:
            busy = False
        start(self)  # already started by the connection; a no-op unless it failed before that

    context.Context.ensure_initialized = ensure_initialized


class _Connection:
    """What ParameterServerStrategyV2._connect_to_cluster reads and sets on the strategy."""

    def __init__(self, resolver: Any) -> None:
        self._cluster_resolver = resolver
        self._num_workers = self._num_ps = 0


def _cardinality(dataset: Any) -> int:
    import tensorflow as tf

    n = int(dataset.cardinality().numpy())
    return {int(tf.data.INFINITE_CARDINALITY): -1, int(tf.data.UNKNOWN_CARDINALITY): -2}.get(n, n)


def _is_dataset(x: Any) -> bool:
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


_ON_COORDINATOR = object()  # fit's validation input, as far as fit knows: run by patched_evaluate


def _nested_arrays(x: Any) -> bool:
    """A dict, list or tuple of arrays (a model of several inputs)."""
    return isinstance(x, (dict, list, tuple)) and bool(x) and all(
        _examples(v) is not None for v in (x.values() if isinstance(x, dict) else x))


def _examples(x: Any) -> int | None:
    """How many examples arrays (numpy, tensors, dataframes) hold; None for anything else."""
    if x is None or isinstance(x, (dict, list, tuple)) or _is_dataset(x):
        return None
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] is not None:
        return int(shape[0])
    return len(x) if hasattr(x, "__len__") else None


def _split(a: dict[str, Any]) -> int:
    """validation_split on arrays, made here as fit makes it (the last examples, before any shuffle),
    so that the step count and the banner count the training examples only: how many were held out."""
    split = a["validation_split"]
    if not split or a["validation_data"] is not None or _examples(a["x"]) is None:
        return 0  # fit's own rules (and errors) for the rest
    from tf_keras.src.engine import data_adapter

    (a["x"], a["y"], a["sample_weight"]), a["validation_data"] = data_adapter.train_validation_split(
        (a["x"], a["y"], a["sample_weight"]), validation_split=split)
    a["validation_split"] = 0.0
    return _examples(data_adapter.unpack_x_y_sample_weight(a["validation_data"])[0]) or 0


class ArraysError(SystemExit):
    """What fit cannot do with arrays under dtf.strategy(): one line, exit code 2, no traceback."""

    def __init__(self, message: str) -> None:
        print(f"dtf: error: {message}{_program_line()}", file=sys.stderr, flush=True)
        super().__init__(2)


def _program_line() -> str:
    from dtf.program.hooks.guards import program_line

    return program_line()


def _off_strategy(call: Any) -> Any:
    """call() outside every strategy scope: in a thread of its own, whose strategy, variable
    creator and device scopes (TensorFlow keeps them per thread) are the defaults. fit has entered
    its strategy's scope, which its validation cannot leave otherwise."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as e:  # handed to the caller's thread
            box.append((False, e))

    thread = threading.Thread(target=run, name="dtf-on-coordinator", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)  # in short waits: Ctrl-C still reaches the caller
    ok, value = box[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _plain(model: Any) -> Iterator[None]:
    """The model as tf-keras' own predict has it under this strategy (see _Wrap.on_coordinator),
    for a call made outside every strategy scope (_off_strategy)."""
    saved = (model._distribution_strategy, model._cluster_coordinator, model.test_function,
             model.predict_function, model._pss_evaluation_shards)
    model._distribution_strategy = model._cluster_coordinator = None
    model.test_function = model.predict_function = None
    model._pss_evaluation_shards = 0
    try:
        yield
    finally:
        (model._distribution_strategy, model._cluster_coordinator, model.test_function,
         model.predict_function, model._pss_evaluation_shards) = saved


def _on_coordinator(model: Any, call: Any) -> Any:
    def plain() -> Any:
        with _plain(model):
            return call()

    return _off_strategy(plain)


def _inputs(validation: Any) -> Any:
    """The inputs of fit's validation_data: the first of a tuple (x, y[, sample_weight])."""
    return validation[0] if isinstance(validation, tuple) and validation else validation


def _arrays_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    x = args[0] if args else kwargs.get("x")
    return _examples(x) is not None


def _patch(_: ModuleType) -> None:
    global _patched
    if _patched:  # --wrap and dtf.strategy() both ask for it
        return
    _patched = True
    from tf_keras.src.engine import base_layer, training

    layer_init, model_init = base_layer.Layer.__init__, training.Model.__init__
    fit, evaluate, predict = training.Model.fit, training.Model.evaluate, training.Model.predict
    fit_signature = inspect.signature(fit)

    def patched_layer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _wrap.enter()
        layer_init(self, *args, **kwargs)

    def patched_model_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _wrap.enter()  # a subclassed Model reads the strategy before its layers exist
        model_init(self, *args, **kwargs)

    def ours(model: Any) -> bool:
        return _wrap.strategy is not None and model.distribute_strategy is _wrap.strategy

    def dtfs(model: Any) -> bool:
        """A model of dtf.strategy()'s ParameterServerStrategy, without --wrap."""
        import dtf

        return (dtf._strategy is not None and not ours(model) and not dtf.collective_mode()
                and model.distribute_strategy is dtf._strategy)

    def fit_arrays(self: Any, *args: Any, **kwargs: Any) -> Any:
        """fit of a dtf.strategy() model: arrays as --wrap has them; the rest as tf-keras does."""
        bound = fit_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        for what in ("x", "validation_data"):
            data = a[what] if what == "x" else _inputs(a[what])
            if _nested_arrays(data):
                raise ArraysError(
                    f"model.fit with {what} a {type(data).__name__} of arrays (a model of several inputs): "
                    f"under ParameterServerStrategy tf-keras takes a single array for x and for y; pass "
                    f"tf.data.Dataset.from_tensor_slices((x, y)).batch(N) and steps_per_epoch instead")
        examples = _examples(a["x"])
        validation = _inputs(a["validation_data"])
        if not (examples is not None and (a["steps_per_epoch"] is None or a["validation_split"])) and not (
                validation is not None and _examples(validation) is not None and a["validation_steps"] is None):
            return fit(self, *args, **kwargs)  # nothing of arrays to change: as the program called it
        held_out = _split(a)
        examples = _examples(a["x"])
        if a["steps_per_epoch"] is None and examples is not None:
            batch = a["batch_size"] or 32
            a["steps_per_epoch"] = math.ceil(examples / batch)
            _arrays.change(f"fit: steps_per_epoch={a['steps_per_epoch']} ({examples} examples in batches of {batch}"
                           + (f"; {held_out} held out by validation_split)" if held_out else ")"))
        validation = a["validation_data"]
        here = (validation is not None and a["validation_steps"] is None and not _is_dataset(validation)
                and _examples(_inputs(validation)) is not None)
        if here:
            _arrays.change("fit's validation on arrays runs here, on the coordinator (every example once)")
        _arrays.report(prefix="")
        # By name: the other hooks that wrap fit read its arguments so (guards: validation_data).
        named = {k: v for k, v in a.items() if k != "self"}
        if not here:
            return fit(self, **named)
        self._eval_data_handler = _ON_COORDINATOR  # as under --wrap: patched_evaluate runs it here
        try:
            return fit(self, **named)
        finally:
            if getattr(self, "_eval_data_handler", None) is _ON_COORDINATOR:
                del self._eval_data_handler

    def patched_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if dtfs(self):
            return fit_arrays(self, *args, **kwargs)
        if not ours(self):
            return fit(self, *args, **kwargs)
        bound = fit_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["verbose"] == 1:
            a["verbose"] = 2
            _wrap.change("fit: verbose=1 -> 2 (no per-batch progress bar under this strategy)")
        held_out = _split(a)
        x = a["x"]
        if a["steps_per_epoch"] is None:
            if _is_dataset(x):
                n = _cardinality(x)
                if n == -1:
                    raise WrapError("model.fit on a dataset that repeats forever needs steps_per_epoch "
                                    "(how many batches make an epoch): pass fit(..., steps_per_epoch=N)")
                if n == -2:
                    raise WrapError("model.fit on a dataset of unknown length needs steps_per_epoch "
                                    "(how many batches make an epoch): pass fit(..., steps_per_epoch=N)")
                a["x"], a["steps_per_epoch"] = x.repeat(), n
                _wrap.change(f"fit: the dataset repeats (every worker reads all of it), steps_per_epoch={n} "
                             f"(its length)")
            elif (examples := _examples(x)) is not None:
                batch = a["batch_size"] or 32
                n = math.ceil(examples / batch)
                a["steps_per_epoch"] = n
                _wrap.change(f"fit: steps_per_epoch={n} ({examples} examples in batches of {batch}"
                             + (f"; {held_out} held out by validation_split)" if held_out else ")"))
            else:
                raise WrapError(f"model.fit on {type(x).__name__} needs steps_per_epoch under "
                                f"ParameterServerStrategy: pass fit(..., steps_per_epoch=N)")
        validating = a["validation_data"] is not None
        if validating:
            _wrap.change("fit's validation runs here, on the coordinator, as evaluate does (every example "
                         "once, whatever its form or size)")
        _wrap.report()
        if not validating:
            return fit(*bound.args, **bound.kwargs)
        # fit builds its validation input on the workers unless one is cached: a stand-in keeps it
        # from doing so (numpy needs validation_steps there, a small dataset fails exact
        # evaluation's sharding), and patched_evaluate runs the validation here.
        self._eval_data_handler = _ON_COORDINATOR
        try:
            return fit(*bound.args, **bound.kwargs)
        finally:
            if getattr(self, "_eval_data_handler", None) is _ON_COORDINATOR:
                del self._eval_data_handler

    def patched_evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if dtfs(self):
            if kwargs.get("_use_cached_eval_dataset") and getattr(self, "_eval_data_handler", None) is _ON_COORDINATOR:
                kwargs.pop("_use_cached_eval_dataset")  # fit's validation on arrays: here
                return _on_coordinator(self, lambda: evaluate(self, *args, **kwargs))
            if _arrays_in(args, kwargs) and kwargs.get("steps") is None:
                return _on_coordinator(self, lambda: evaluate(self, *args, **kwargs))
            return evaluate(self, *args, **kwargs)
        if not ours(self):
            return evaluate(self, *args, **kwargs)
        if kwargs.pop("_use_cached_eval_dataset", False):  # fit's validation
            if getattr(self, "_eval_data_handler", None) is not _ON_COORDINATOR:
                return evaluate(self, *args, _use_cached_eval_dataset=True, **kwargs)
        else:
            _wrap.report()
        # On the workers, evaluate(finite dataset) fails (OutOfRangeError: every worker reads all of
        # it), and exact evaluation fails on a small dataset made from tensors ("Could not apply FILE
        # based sharding"): here, it is what it is on one machine.
        with _wrap.on_coordinator(self):
            return evaluate(self, *args, **kwargs)

    def patched_predict(self: Any, *args: Any, **kwargs: Any) -> Any:
        if dtfs(self) and _arrays_in(args, kwargs):  # tf-keras' own takes a dataset only here
            return _on_coordinator(self, lambda: predict(self, *args, **kwargs))
        if not ours(self):
            return predict(self, *args, **kwargs)
        # tf-keras' own predict under this strategy takes a dataset only (it iterates it here):
        # arrays and tensors, as on one machine, need the model out of the strategy.
        with _wrap.on_coordinator(self):
            return predict(self, *args, **kwargs)

    base_layer.Layer.__init__ = patched_layer_init
    training.Model.__init__ = patched_model_init
    training.Model.fit = patched_fit
    training.Model.evaluate = patched_evaluate
    training.Model.predict = patched_predict
