"""Never train on the laptop by mistake: under `dtf train` (ParameterServerStrategy mode), a training
step that would run in this program rather than on the cluster ends the program with one line,
before the step runs, and exit code 9 (dtf.errors.ExitCode.NOT_ON_CLUSTER).

- tf-keras `Model.fit`/`train_on_batch` of a model made under no strategy (a single-machine script
  run without `--wrap`, or a model built outside `strategy.scope()`), and a tf-keras optimizer's
  `apply_gradients` under no strategy, or under a ParameterServerStrategy but not in a function
  scheduled on the workers (a custom loop whose steps run here).
- A Keras 3 model's `fit`/`train_on_batch` (`import keras` with keras 3.x): Keras 3 has no
  ParameterServerStrategy (https://github.com/keras-team/keras/issues/18624); tf-keras has it, and
  `TF_USE_LEGACY_KERAS=1` (set by `dtf train`) makes `tf.keras` resolve to it.

A program that imported TensorFlow and ended without making any strategy (it never used the
cluster: a loop of its own that no check above saw) is the same error at its end
(`check_at_end`, called by dtf.program.runner).

A strategy of the program's own other than ParameterServerStrategy (MirroredStrategy,
OneDeviceStrategy, MultiWorkerMirroredStrategy...) would run on this machine's devices, or not at
all on this cluster of ps and workers: it is refused when it is made, with the fix (`dtf.strategy()`,
`--wrap` without it, `--collective`). A ParameterServerStrategy the program makes itself (from
TF_CONFIG, which `dtf train` sets) runs on the cluster and is left alone. `dtf train --collective`,
whose copies run on the hosts, is left alone.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dtf.errors import ExitCode
from dtf.program.hooks import on_import, wrap
from dtf.program.hooks.guards import program_line

FIX = ("run `dtf train --wrap PROGRAM` (a single-machine script, unchanged), or build and compile the model "
       "inside `with dtf.strategy().scope():`")


class NotOnCluster(SystemExit):
    """One line, exit code 9, no traceback (raised in the program)."""

    def __init__(self, message: str) -> None:
        print(f"dtf: error: {message}{program_line()}", file=sys.stderr, flush=True)
        super().__init__(int(ExitCode.NOT_ON_CLUSTER))


def under_ps_train() -> bool:
    """This program is the coordinator of a `dtf train` run (not a collective copy, not a plain run)."""
    if not os.environ.get("DTF_CLUSTER") or os.environ.get("DTF_COLLECTIVE") == "1":
        return False
    try:
        return bool(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("type") == "chief")
    except (ValueError, AttributeError):
        return False


_made: list[str] = []  # the strategies the program made (class names)


def install() -> None:
    if under_ps_train():
        on_import("tensorflow", _patch_strategies)
        on_import("tf_keras", _patch_tf_keras)
        on_import("keras", _patch_keras)


def check_at_end() -> None:
    """At the program's normal end: it imported TensorFlow and made no strategy: an error."""
    if under_ps_train() and "tensorflow" in sys.modules and not _made:
        raise NotOnCluster(f"the program ended without making a strategy: nothing ran on the cluster; {FIX}")


def _patch_strategies(_: ModuleType) -> None:
    from tensorflow.python.distribute import distribute_lib

    init = distribute_lib.StrategyBase.__init__

    @functools.wraps(init)
    def init_(self: Any, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        if name != "_DefaultDistributionStrategy":  # TensorFlow's own, made on first use
            if "ParameterServerStrategy" not in name:
                raise NotOnCluster(local_strategy(name))
            _made.append(name)
        init(self, *args, **kwargs)

    distribute_lib.StrategyBase.__init__ = init_


def local_strategy(name: str) -> str:
    """The error for a strategy of the program's own that is not a ParameterServerStrategy."""
    if "Collective" in name or "MultiWorker" in name:
        name = "MultiWorkerMirroredStrategy"  # tf.distribute's name of CollectiveAllReduceStrategy
        return (f"the program made a {name}: under `dtf train` the program is the coordinator of ps and "
                f"workers (ParameterServerStrategy); run it with `dtf train --collective PROGRAM` (one copy "
                f"per worker), or make the strategy with `dtf.strategy()`")
    if os.environ.get(wrap.ENV) == "1":
        return (f"the program made a {name}, which would train on this machine's devices, not on the cluster; "
                f"--wrap supplies the cluster's strategy: drop the {name} and its scope, or make it with "
                f"`dtf.strategy()` in its place")
    return (f"the program made a {name}, which would train on this machine's devices, not on the cluster; "
            f"make the strategy with `dtf.strategy()` in its place, or drop it and run `dtf train --wrap "
            f"PROGRAM` (a single-machine script)")


def _no_strategy(strategy: Any) -> bool:
    """No strategy is in use here: none is current, and `strategy` (what the model or optimizer was made
    under) is none or the default one."""
    import tensorflow as tf

    return not tf.distribute.has_strategy() and (strategy is None or strategy is tf.distribute.get_strategy())


def _unscheduled(strategy: Any) -> bool:
    """A ParameterServerStrategy's step that runs here: not traced for `ClusterCoordinator.schedule`
    (which sets `_being_scheduled` while it traces the function it sends to the workers:
    tensorflow/python/distribute/coordinator/cluster_coordinator.py), nor where tf-keras lets the
    strategy run without its coordinator (`_allow_run_without_coordinator`)."""
    if strategy is None or "ParameterServerStrategy" not in type(strategy).__name__:
        return False
    extended = strategy.extended
    return not getattr(extended, "_being_scheduled", True) and not getattr(extended, "_allow_run_without_coordinator",
                                                                            False)


def _checked(method: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _no_strategy(self._distribution_strategy):
            raise NotOnCluster(f"{what} would train on this machine, not on the cluster: the model was made "
                               f"under no strategy; {FIX}")
        return method(self, *args, **kwargs)

    return checked


def _patch_tf_keras(_: ModuleType) -> None:
    from tf_keras.src.engine import training
    from tf_keras.src.optimizers import optimizer
    from tf_keras.src.optimizers.legacy import optimizer_v2

    training.Model.fit = _checked(training.Model.fit, "model.fit")
    training.Model.train_on_batch = _checked(training.Model.train_on_batch, "model.train_on_batch")
    apply_new, apply_legacy = optimizer.Optimizer.apply_gradients, optimizer_v2.OptimizerV2.apply_gradients

    def checked_apply(apply: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(apply)
        def apply_gradients(self: Any, *args: Any, **kwargs: Any) -> Any:
            strategy = getattr(self, "_distribution_strategy", None)
            if _no_strategy(strategy):
                raise NotOnCluster("optimizer.apply_gradients would train on this machine, not on the cluster: "
                                   "the training step runs under no strategy; schedule it on the workers "
                                   "(`dtf.coordinator().schedule(step)`, with `strategy.run` inside and the "
                                   "model built inside `with dtf.strategy().scope():`), or use model.fit "
                                   "under `dtf train --wrap`")
            if _unscheduled(strategy):
                raise NotOnCluster("optimizer.apply_gradients would train on this machine, not on the cluster: "
                                   "the training step runs here, not in a function scheduled on the workers; "
                                   "schedule it (`dtf.coordinator().schedule(step)`, a tf.function with "
                                   "`strategy.run` inside), or use model.fit")
            return apply(self, *args, **kwargs)

        return apply_gradients

    optimizer.Optimizer.apply_gradients = checked_apply(apply_new)
    optimizer_v2.OptimizerV2.apply_gradients = checked_apply(apply_legacy)


def _patch_keras(keras: ModuleType) -> None:
    version = str(getattr(keras, "__version__", ""))
    model = getattr(keras, "Model", None)
    if not version.startswith("3.") or model is None:
        return

    def refused(method: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
            legacy = os.environ.get("TF_USE_LEGACY_KERAS", "")
            use = ("`tf.keras` (dtf train sets TF_USE_LEGACY_KERAS=1: tf.keras is tf-keras)"
                   if legacy.lower() in ("1", "true") else
                   f"`tf.keras` with TF_USE_LEGACY_KERAS=1 (the program set it to {legacy!r}: leave it as "
                   f"dtf train sets it)")
            raise NotOnCluster(
                f"model.{name} on a Keras 3 model (keras {version}): Keras 3 cannot train under "
                f"ParameterServerStrategy (keras-team/keras#18624), so it would train on this machine; use "
                f"tf-keras: {use} or `import tf_keras as keras` in place of `import keras`")

        return refuse

    for name in ("fit", "train_on_batch"):
        setattr(model, name, refused(getattr(model, name), name))
