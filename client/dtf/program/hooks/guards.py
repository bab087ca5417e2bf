"""Guard rails: what would cost the user minutes and end in an unreadable error, said in one line
before it happens.

- An in-graph dataset near the 2 GB limit. A `tf.data.Dataset` built here from in-memory data
  (`from_tensor_slices`/`from_tensors` of numpy arrays, tensors captured by its functions) is
  serialized WITH its data and rebuilt on every worker; past protobuf's 2 GB that fails on the
  workers with `FetchOutputs node : not found [[{{node DatasetFromGraph}}]]` (the dataset travels as
  one GraphDef: tensorflow/python/data/ops/dataset_ops.py, `_as_serialized_graph`).
  A `dataset_fn` that builds one from numpy holds the data as constants of the function sent to
  the workers, with the same limit. dtf estimates the size when the dataset is distributed and
  stops the program above `DTF_DATASET_LIMIT` bytes (default 1.8e9): an error.
- Keras 3 when the strategy is made: its `Model.fit` cannot train under ParameterServerStrategy
  (keras-team/keras#18624). An error where `tf.keras` itself is Keras 3 (TF_USE_LEGACY_KERAS unset
  by the program); a warning where only `import keras` brought Keras 3 in beside tf-keras.
- ssh network mode (DTF_NETWORK=ssh): what makes the workers call the coordinator back
  (`Dataset.from_generator`, `tf.py_function`/`numpy_function` in a dataset, a variable or resource
  made outside `strategy.scope()` and used in a scheduled function). dtf's tunnel forwards those
  calls back to the laptop through SSH, so they work, but every element or step then crosses the
  laptop's link twice: a warning, once per kind.

- Exact evaluation (`compile(pss_evaluation_shards=N)`) of a dataset of fewer batches than N
  shards: TensorFlow fails on the workers ("Could not apply FILE based sharding", whatever the
  dataset's auto-shard policy: tf_keras/src/engine/training.py, `shard_test_function`). Said
  before fit or evaluate runs, with the ways out: an error.

Errors end the program with `dtf: error: ...` (exit code 1, no traceback); warnings print
`dtf: warning: ...` and the program goes on.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from dtf.program.hooks import on_import

LIMIT_ENV = "DTF_DATASET_LIMIT"
DEFAULT_LIMIT = 1.8e9  # bytes: protobuf's limit is 2 GiB, and the graph has more than the data
PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
_warned: set[str] = set()
_checked_functions: set[int] = set()
_strategy_made = False


def install() -> None:
    on_import("tensorflow", _patch)
    on_import("keras", _keras_imported)
    on_import("tf_keras", _patch_exact_evaluation)


def _patch(tf: ModuleType) -> None:
    from tensorflow.python.distribute import parameter_server_strategy_v2
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    pss = parameter_server_strategy_v2.ParameterServerStrategyV2
    pss.__init__ = _checking_keras(pss.__init__)
    coordinator = cluster_coordinator.ClusterCoordinator
    coordinator.create_per_worker_dataset = _checking_datasets(coordinator.create_per_worker_dataset)
    if os.environ.get("DTF_NETWORK") == "ssh":
        closure = cluster_coordinator.Closure
        closure.__init__ = _checking_captures(closure.__init__)


def fail(message: str) -> None:
    """End the program with one line (SystemExit: exit code 1, no traceback)."""
    raise SystemExit(f"dtf: error: {message}{program_line()}")


def warn(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        print(f"dtf: warning: {message}{program_line()}", file=sys.stderr, flush=True)


def program_line() -> str:
    """' (program.py:LINE)': the program's own line that led here, if any."""
    program = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    for frame in reversed(traceback.extract_stack()):
        if program and os.path.abspath(frame.filename) == program:
            return f" ({os.path.basename(program)}:{frame.lineno})"
    return ""


# ---- Keras 3 ---------------------------------------------------------------------------------

def _checking_keras(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_(self: Any, *args: Any, **kwargs: Any) -> None:
        global _strategy_made
        check_keras()
        init(self, *args, **kwargs)
        _strategy_made = True

    return init_


def _keras_imported(keras: ModuleType) -> None:
    if _strategy_made:  # else the strategy's constructor checks
        check_keras()


def check_keras() -> None:
    keras = sys.modules.get("keras")
    version = str(getattr(keras, "__version__", ""))
    if not version.startswith("3."):
        return
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() not in ("1", "true"):
        fail(f"tf.keras is Keras 3 ({version}), whose Model.fit cannot train under ParameterServerStrategy: "
             f"leave TF_USE_LEGACY_KERAS=1 (dtf train sets it) so that tf.keras is tf-keras")
    from dtf.program import tfkeras

    if tfkeras.keras3_from_tensorflow():
        return  # TensorFlow's own import of it, before dtf chose tf-keras: not the program's
    warn("keras3", f"the program imported Keras 3 (keras {version}): models made with it cannot fit under "
                   f"ParameterServerStrategy; use tf.keras (tf-keras under dtf train) or `import tf_keras`")


# ---- exact evaluation ------------------------------------------------------------------------

def _patch_exact_evaluation(_: ModuleType) -> None:
    from tf_keras.src.engine import training

    fit, evaluate = training.Model.fit, training.Model.evaluate

    @functools.wraps(fit)
    def fit_(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A cached evaluation input (--wrap's stand-in: validation on the coordinator) is not sharded.
        if kwargs.get("validation_steps") is None and getattr(self, "_eval_data_handler", None) is None:
            check_shards(self, kwargs.get("validation_data"), "fit's validation_data")
        return fit(self, *args, **kwargs)

    @functools.wraps(evaluate)
    def evaluate_(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("steps") is None and not kwargs.get("_use_cached_eval_dataset"):
            check_shards(self, args[0] if args else kwargs.get("x"), "evaluate's dataset")
        return evaluate(self, *args, **kwargs)

    training.Model.fit, training.Model.evaluate = fit_, evaluate_


def check_shards(model: Any, data: Any, what: str) -> None:
    """Exact evaluation of `data` needs at least one batch per shard (compile sets the shards only
    under this strategy)."""
    shards = getattr(model, "_pss_evaluation_shards", 0)
    dataset = _plain_dataset(data) if data is not None and shards else None
    if dataset is None:
        return
    batches = int(dataset.cardinality().numpy())
    if 0 <= batches < shards:
        fail(f"exact evaluation splits {what} into {shards} shards (pss_evaluation_shards), and it has "
             f"{batches} batches: TensorFlow cannot shard it on the workers (\"Could not apply FILE based "
             f"sharding\"); compile with pss_evaluation_shards={max(batches, 1)} or less, use smaller batches, "
             f"or run a single-machine script with `dtf train --wrap` (it evaluates on the coordinator)")


# ---- datasets --------------------------------------------------------------------------------

def _checking_datasets(create: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(create)
    def create_(self: Any, dataset_fn: Any) -> Any:
        dataset = _plain_dataset(dataset_fn)
        if dataset is not None:  # checked before TensorFlow serializes it
            check_size(in_graph_bytes(dataset))
        per_worker = create(self, dataset_fn)
        if dataset is None:  # a dataset_fn, traced by now: its in-memory data are constants in it
            check_size(function_bytes(getattr(per_worker, "_dataset_fn", None)))
        if os.environ.get("DTF_NETWORK") == "ssh":
            if dataset is not None:
                ops = {op for d in _walk(dataset) for op in _dataset_ops(d)}
            else:  # a dataset_fn: traced into one function, its datasets' functions included
                ops = _function_ops(getattr(per_worker, "_dataset_fn", None))
            if ops & PY_FUNC_OPS:
                warn("pyfunc", "the dataset runs Python (Dataset.from_generator, tf.py_function or "
                               "tf.numpy_function): the workers call this program back for each element, "
                               "in ssh mode through SSH to the laptop; read files in a dataset_fn on the "
                               "workers instead")
        return per_worker

    return create_


def _plain_dataset(value: Any) -> Any:
    """The tf.data.Dataset that will be serialized for the workers, if `value` is one."""
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.distribute import input_lib

    if isinstance(value, input_lib.DistributedDataset):
        value = value._original_dataset
    return value if isinstance(value, dataset_ops.DatasetV2) else None


def check_size(size: int) -> None:
    limit = float(os.environ.get(LIMIT_ENV) or DEFAULT_LIMIT)
    if size > limit:
        fail(f"the dataset holds {_human(size)} of in-memory data, and TensorFlow sends a dataset "
             f"to every worker as one graph of at most 2 GB ({LIMIT_ENV}={limit:g}): write the data to "
             f"files and read them on the workers, in a dataset_fn (e.g. TFRecord)")


def _human(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def in_graph_bytes(dataset: Any) -> int:
    """Bytes of data a dataset carries in its graph: the tensors of its from_tensor_slices and
    from_tensors sources, and the tensors its functions capture (an estimate: strings count
    their bytes, other variants nothing)."""
    total = 0
    for d in _walk(dataset):
        tensors = list(getattr(d, "_tensors", ()))
        for wrapper in _functions(d):
            tensors += wrapper.function.captured_inputs
        total += sum(_nbytes(t) for t in tensors)
    return total


def function_bytes(function: Any) -> int:
    """Bytes of data a traced function carries: its constants and the tensors it captures."""
    graph = getattr(function, "graph", None)
    if graph is None:
        return 0
    consts = [op.outputs[0] for op in graph.get_operations() if op.type == "Const"]
    return sum(_nbytes(t) for t in [*consts, *function.captured_inputs])


def _nbytes(tensor: Any) -> int:
    import tensorflow as tf

    if tensor.dtype in (tf.resource, tf.variant):
        return 0
    if tensor.dtype == tf.string:  # a graph's string constant is not worth reading back: 0
        return int(sum(len(s) for s in tensor.numpy().ravel())) if hasattr(tensor, "numpy") else 0
    return int(tensor.shape.num_elements() or 0) * int(tensor.dtype.size)


def _walk(dataset: Any) -> Iterator[Any]:
    """The dataset and every dataset it reads from, once each."""
    seen: set[int] = set()
    stack = [dataset]
    while stack:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        yield d
        stack.extend(d._inputs())


def _functions(dataset: Any) -> list[Any]:
    try:
        return list(dataset._functions())
    except (AttributeError, NotImplementedError):
        return []


def _dataset_ops(dataset: Any) -> set[str]:
    return {op for wrapper in _functions(dataset) for op in _function_ops(wrapper.function)}


def _function_ops(function: Any) -> set[str]:
    """The op types of a traced function, with those of every function it calls."""
    graph = getattr(function, "graph", None)
    if graph is None:
        return set()
    graph_def = graph.as_graph_def()
    return {n.op for n in graph_def.node} | {n.op for f in graph_def.library.function for n in f.node_def}


# ---- captures (ssh mode) ---------------------------------------------------------------------

def _checking_captures(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        function = getattr(self, "_concrete_function", None)
        if function is None or id(function) in _checked_functions:
            return
        _checked_functions.add(id(function))  # once per traced function: schedule is a hot path
        if any(_on_coordinator(t) for t in function.captured_inputs):
            warn("captured", "a scheduled function uses a variable or resource made outside "
                             "strategy.scope(): it lives in this program, and the workers call it "
                             "back at every step, in ssh mode through SSH to the laptop; make it "
                             "inside `with strategy.scope():`")

    return init_


def _on_coordinator(tensor: Any) -> bool:
    import tensorflow as tf

    return bool(tensor.dtype == tf.resource and "/job:chief/" in (getattr(tensor, "device", "") or ""))
