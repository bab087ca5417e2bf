"""dtf.program.hooks.saving's default I/O device, on a stand-in for TensorFlow's options classes (no
TensorFlow here: the real classes are exercised end to end in tests/e2e/test_saving.py)."""

from __future__ import annotations

from typing import Any

import pytest

import dtf
from dtf.program.hooks import saving


class Options:  # the shape of tf.saved_model.SaveOptions: the device is not the first argument
    def __init__(self, namespace_whitelist: Any = None, experimental_io_device: Any = None) -> None:
        self.namespace_whitelist = namespace_whitelist
        self.experimental_io_device = experimental_io_device


Options.__init__ = saving._defaulting(Options.__init__)  # type: ignore[method-assign]


def test_the_coordinator_is_the_default_once_a_strategy_exists_and_the_programs_own_device_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert Options().experimental_io_device is None  # no strategy yet: no coordinator device
    monkeypatch.setattr(saving, "_strategy_made", True)
    assert Options().experimental_io_device == dtf.COORDINATOR_DEVICE
    assert Options(["x"]).experimental_io_device == dtf.COORDINATOR_DEVICE
    assert Options(experimental_io_device="/job:ps/task:0").experimental_io_device == "/job:ps/task:0"
    assert Options(None, None).experimental_io_device is None  # named, even as None: TensorFlow's placement
    assert Options(experimental_io_device=None).experimental_io_device is None
