"""Which Keras `tf.keras` is, told without binding it; and tf-keras chosen after `import tensorflow`.

dtf needs `tf.keras` to be tf-keras: Keras 3 has no ParameterServerStrategy (keras-team/keras#18624).
TensorFlow (2.16 and later) makes `tf.keras`, and its aliases `tf.losses`, `tf.metrics`,
`tf.optimizers` and `tf.initializers`, lazy loaders (tensorflow/python/util/lazy_loader.py,
`KerasLazyLoader`): each picks Keras 3 or tf-keras at its first attribute access, by
TF_USE_LEGACY_KERAS as it is then, and puts the module it loads in the loader's place among
tensorflow's attributes. So a program or a kernel that imported TensorFlow before dtf still gets
tf-keras if the variable is set before anything uses `tf.keras`; only a `tf.keras` already bound to
Keras 3 is past saving (`keras3_bound`, which reads the loaders' state and binds nothing).

Two things `import tensorflow` decides at once by the variable (tensorflow/__init__.py), which
`use_tf_keras` makes as TensorFlow makes them with it set:
- Keras 3's API folder is put first on `tensorflow.__path__`, where `from tensorflow.keras import
  layers` finds `tensorflow.keras` as a submodule (not through the loader): tf-keras's takes its place;
- Keras 3's optimizers are imported (`keras.src.optimizers`, to register them): Keras 3 is then in
  sys.modules, unused. The guard that warns about a program's own `import keras` keeps quiet about
  this one (`keras3_from_tensorflow`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

LEGACY_ENV = "TF_USE_LEGACY_KERAS"
# tensorflow's attributes that are Keras lazy loaders (tensorflow/__init__.py).
LOADERS = ("keras", "losses", "metrics", "optimizers", "initializers")

_keras3_from_tensorflow = False


def legacy_set() -> bool:
    """TF_USE_LEGACY_KERAS says tf-keras (as TensorFlow reads it)."""
    return os.environ.get(LEGACY_ENV) in ("true", "True", "1")


def binding(tf: ModuleType, name: str = "keras") -> str | None:
    """What `tf.NAME` is bound to: "tf_keras", "keras_3", "keras_2", or None while its loader has
    not chosen (or TensorFlow has no such attribute). Binds nothing: reads the loader's own fields."""
    obj = vars(tf).get(name)
    if obj is None:
        return None
    if type(obj).__name__ == "KerasLazyLoader":
        fields = vars(obj)  # not getattr: an attribute the loader lacks would make it choose
        return str(fields["_tfll_keras_version"]) if fields.get("_tfll_initialized") else None
    # A module in the loader's place: tf-keras's (tf_keras.api._v2.keras) or Keras 3's
    # (keras._tf_keras.keras), or `tensorflow.keras` imported from the folder one of them put first
    # on tensorflow.__path__: told by the package its file is in.
    name = str(getattr(obj, "__name__", ""))
    if name.split(".")[0] == "tf_keras" or "tf_keras" in Path(str(getattr(obj, "__file__", ""))).parts:
        return "tf_keras"
    version = str(getattr(sys.modules.get("keras"), "__version__", ""))
    return "keras_3" if version.startswith("3.") else "keras_2"


def keras3_bound(tf: ModuleType | None = None) -> list[str]:
    """`tf.keras` and its aliases already bound to Keras 3 in this process, e.g. ["tf.keras"]."""
    tf = tf if tf is not None else sys.modules.get("tensorflow")
    if tf is None:
        return []
    return [f"tf.{name}" for name in LOADERS if binding(tf, name) == "keras_3"]


def refusal(tf: ModuleType | None = None) -> str | None:
    """One line for a process whose `tf.keras` is already Keras 3; None if it is not (yet)."""
    bound = keras3_bound(tf)
    if not bound:
        return None
    return (f"{', '.join(bound)} {'is' if len(bound) == 1 else 'are'} already Keras 3 in this process (used "
            f"before dtf was imported), which has no ParameterServerStrategy: import dtf before the first use "
            f"of tf.keras (in a notebook: restart the kernel, then import dtf first)")


def use_tf_keras() -> None:
    """Make `tf.keras` resolve to tf-keras, from now on: TF_USE_LEGACY_KERAS=1 unless the program set
    it; where TensorFlow was imported without it and nothing bound `tf.keras` yet, what its import
    decided put as it decides it with the variable set (see the module's docstring)."""
    global _keras3_from_tensorflow
    os.environ.setdefault(LEGACY_ENV, "1")
    tf = sys.modules.get("tensorflow")
    if tf is None or not legacy_set() or getattr(tf, "_tf_uses_legacy_keras", True) is not False:
        return
    if binding(tf) is not None:
        return  # bound already: refusal() says so where it matters
    _keras3_from_tensorflow = _keras3_from_tensorflow or "keras" in sys.modules
    try:
        from tensorflow.python.tools import module_util

        keras3 = module_util.get_parent_dir_for_name("keras.api._v2.keras")
        legacy = module_util.get_parent_dir_for_name("tf_keras.api._v2.keras")
    except (ImportError, AttributeError, ValueError):
        return
    if legacy is None:
        return  # no tf-keras installed: TensorFlow's loader says so at the first use
    tf.__path__ = [legacy if p == keras3 else p for p in tf.__path__]
    if legacy not in tf.__path__:
        tf.__path__.insert(0, legacy)


def keras3_from_tensorflow() -> bool:
    """Keras 3 is in sys.modules because TensorFlow imported it (without TF_USE_LEGACY_KERAS),
    before dtf chose tf-keras (a program's own `import keras` may be there too: not told apart)."""
    return _keras3_from_tensorflow
