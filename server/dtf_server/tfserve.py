"""One tf.distribute.Server, started without `import tensorflow`.

A task's server runs no Python of the model: the coordinator sends it graphs, and TensorFlow's C++
runtime (gRPC, the eager service, every op's kernel) executes them. All of that lives in the shared
libraries that `tensorflow.python.training.server_lib` loads (`_pywrap_tensorflow_internal`,
`libtensorflow_cc`, `libtensorflow_framework`). `import tensorflow` loads much more for the Python
API: Keras's lazy loader, tf.lite, MLIR, the profiler, dtensor, h5py, PIL, and thousands of modules.
The lean import below loads the shared libraries and the few modules around them only: a small
part of `import tensorflow`'s CPU, which every server pays before it serves.

What the lean import leaves out, checked against TensorFlow 2.21 (`TF_GetAllOpList` in both): one
op, `AudioMicrofrontend` (tf.lite's experimental audio front end, loaded from its own library), and
the libraries `import tensorflow` loads besides (tensorflow/__init__.py): kernels in
`tensorflow/core/kernels/`, plugins in a `tensorflow-plugins` directory of any site directory, and
a pluggable device named by `TF_PLUGGABLE_DEVICE_LIBRARY_PATH`. A host with any of those gets the
full import, as does a TensorFlow whose layout the lean import does not find, or `serve --full`
(`DTF_SERVER=tensorflow:full` in the environment of `dtf up`).

The lean import puts an empty `tensorflow` package in `sys.modules` so that `tensorflow/__init__.py`
is not run: nothing else in this process may import TensorFlow's Python API after it. The server
process runs only `serve`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from typing import Any

from dtf_server.procs import write_json

FULL = "full"


def _site_dirs() -> set[str]:
    """The directories tensorflow/__init__.py looks in for `tensorflow-plugins`."""
    import site
    import sysconfig

    dirs = {p for p in sys.path if "site-packages" in p}
    if site.ENABLE_USER_SITE and site.USER_SITE is not None:
        dirs.add(site.USER_SITE)
    dirs.update(getattr(site, "getsitepackages", list)())
    for scheme in sysconfig.get_scheme_names():
        dirs.update(sysconfig.get_path(name, scheme) for name in ("purelib", "platlib"))
    return dirs


def _loads_more(package_dirs: list[str]) -> bool:
    """Whether `import tensorflow` would load libraries the lean import would not."""
    return (bool(os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"))
            or any(os.path.isdir(os.path.join(d, "core", "kernels")) for d in package_dirs)
            or any(os.path.isdir(os.path.join(d, "tensorflow-plugins")) for d in _site_dirs()))


def server_lib(full: bool = False) -> tuple[Any, str]:
    """TensorFlow's server module, and how it was imported: "lean" or "full" (see the docstring)."""
    if not full and "tensorflow" not in sys.modules:
        spec = importlib.util.find_spec("tensorflow")
        if spec is not None and spec.submodule_search_locations and not _loads_more(
                list(spec.submodule_search_locations)):
            package = types.ModuleType("tensorflow")
            package.__path__ = list(spec.submodule_search_locations)
            package.__spec__ = spec
            sys.modules["tensorflow"] = package
            try:
                from tensorflow.python import tf2
                from tensorflow.python.training import server_lib as lean

                tf2.enable()  # as `import tensorflow` does (the C++ side reads it, e.g. for XLA's bridge)
                return lean, "lean"
            except Exception:  # another layout: forget what was loaded, import it all
                for name in [n for n in sys.modules if n == "tensorflow" or n.startswith("tensorflow.")]:
                    del sys.modules[name]
    import tensorflow  # noqa: F401
    from tensorflow.python.training import server_lib  # tf.train.ClusterSpec, tf.distribute.Server

    return server_lib, FULL


def serve(job: str, index: int, port: int, ready: str, full: bool = False) -> None:
    lib, how = server_lib(full)
    # A cluster spec holding only this task is enough: the coordinator sends its own cluster
    # definition to every task when it connects (CreateContext's server_def:
    # tensorflow/core/distributed_runtime/eager/eager_service_impl.cc).
    cluster = lib.ClusterSpec({job: {index: f"localhost:{port}"}})
    server = lib.Server(cluster, job_name=job, task_index=index, protocol="grpc", start=True)
    write_json(ready, {"pid": os.getpid(), "target": server.target, "time": time.time(), "import": how})
    print(f"dtf: {job}:{index} serving on port {port} ({how} import)", flush=True)
    server.join()  # never returns; SIGTERM's default action ends the process
