"""What dtf does inside the user's program under `dtf train` (installed by dtf.program.runner before the
program's first line runs). One module per feature; each reads its settings from the environment
that `dtf train` gave the program (dtf.program.train.program_env) and does nothing where they are unset.

Hooks must not import TensorFlow themselves unless the feature needs it before the program does:
where they patch TensorFlow or tf-keras, they do it when the program imports it (see `on_import`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

# The features, in the order they are installed: (module name in dtf.program.hooks, its install function).
FEATURES: list[str] = ["saving", "guards", "oncluster", "recovery", "packing", "roundtrips", "wrap", "collective",
                       "figures"]


def install(features: Sequence[str] | None = None) -> None:
    """Install every feature's hook (or only `features`)."""
    import importlib

    for name in FEATURES if features is None else features:
        importlib.import_module(f"dtf.program.hooks.{name}").install()


class _After(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module is first imported (once each)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target) if find else None
            if spec is not None and spec.loader is not None:
                # The callbacks are taken when the module is executed, not here: a find_spec
                # alone (TensorFlow's `importlib.util.find_spec("tf_keras")`, to see whether it is
                # installed) imports nothing, and would otherwise lose them.
                spec.loader = _Loader(spec.loader, fullname, self.pending)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str,
                 pending: dict[str, list[Callable[[ModuleType], None]]]) -> None:
        self.inner, self.name, self.pending = inner, name, pending

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for callback in self.pending.pop(self.name, []):
            callback(module)


_after = _After()


def on_import(module: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once `module` is imported: now if it already is, else right after
    the program first imports it."""
    if module in sys.modules:
        callback(sys.modules[module])
        return
    if _after not in sys.meta_path:
        sys.meta_path.insert(0, _after)
    _after.pending.setdefault(module, []).append(callback)
