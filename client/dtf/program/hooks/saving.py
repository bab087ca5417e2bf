"""Saves on the laptop by default: checkpoint and SavedModel I/O happens in the program.

Under ParameterServerStrategy the variables live on the ps, and TensorFlow runs a checkpoint's
save and restore ops next to them: without an I/O device each ps reads and writes ITS OWN disk (a
relative path is even relative to the server's working directory), and a stock ModelCheckpoint
fails with `./ckpt_1_temp; No such file or directory [[{{node SaveV2}}]]` on hosts that do not
share the laptop's filesystem (save ops sit on the variables' device unless an I/O device is given:
tensorflow/python/checkpoint/functional_saver.py, MultiDeviceSaver).

Every saving path of TensorFlow and tf-keras (tf.train.Checkpoint and CheckpointManager, Keras'
save_weights / load_weights, ModelCheckpoint, BackupAndRestore, model.save, tf.saved_model.save
and load) builds a `tf.train.CheckpointOptions`, `tf.saved_model.SaveOptions` or `LoadOptions`
when the program passes none (`options or CheckpointOptions()`). This hook gives those three
classes the coordinator's device (dtf.COORDINATOR_DEVICE) as their default
`experimental_io_device`, so all of them read and write here. A device the program names
itself, `None` included, wins.

The default applies once the program has made a ParameterServerStrategy: before that there is no
coordinator device (the program is not connected to the cluster), and a program that never makes
one saves as TensorFlow always does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import dtf
from dtf.program.hooks import on_import

IO_DEVICE = "experimental_io_device"
_strategy_made = False


def install() -> None:
    if dtf.under_dtf():
        on_import("tensorflow", _patch)


def _patch(tf: ModuleType) -> None:
    from tensorflow.python.checkpoint import checkpoint_options
    from tensorflow.python.distribute import parameter_server_strategy_v2
    from tensorflow.python.saved_model import load_options, save_options

    for cls in (checkpoint_options.CheckpointOptions, save_options.SaveOptions, load_options.LoadOptions):
        cls.__init__ = _defaulting(cls.__init__)
    pss = parameter_server_strategy_v2.ParameterServerStrategyV2
    pss.__init__ = _noting_strategy(pss.__init__)


def _defaulting(init: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(init)

    @functools.wraps(init)
    def init_(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _strategy_made and IO_DEVICE not in signature.bind(self, *args, **kwargs).arguments:
            self.experimental_io_device = dtf.COORDINATOR_DEVICE

    return init_


def _noting_strategy(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_(self: Any, *args: Any, **kwargs: Any) -> None:
        global _strategy_made
        init(self, *args, **kwargs)
        _strategy_made = True

    return init_
