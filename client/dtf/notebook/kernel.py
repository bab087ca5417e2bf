"""What a kernel needs in-process to be a dtf coordinator: dtf's hooks (dtf.program.hooks, which a
`dtf train` script gets from dtf.program.runner) and TensorFlow's C++ noise kept out of the cells.

`python -m dtf.notebook.kernel -f CONNECTION_FILE` is the kernel `dtf train NOTEBOOK.ipynb` runs
(dtf.notebook.execute): ipykernel's own, with `setup()` done after ipykernel captured fd 1 and 2
(what reaches them then shows in a cell) and before the notebook's first cell.

The noise: TensorFlow's C++ runtime writes to fd 2, not to Python's sys.stderr. In a kernel,
ipykernel forwards fd 2 into the running cell (its OutStream's fd capture), so dtf puts a pipe in
front of it and copies what is not noise (dtf.program.noise) to where fd 2 went before. What
TensorFlow writes at its import comes before that if TensorFlow was imported before dtf.connect().
"""

from __future__ import annotations

import logging
import os
import sys

_done: set[str] = set()


def setup(quiet: bool = True) -> None:
    """Install dtf's hooks (once) and, with `quiet`, filter fd 2 (once). The environment must be
    the one `dtf train` gives a program (dtf.program.train.program_env) by then."""
    from dtf.program import hooks, runner

    if "hooks" not in _done:
        _done.add("hooks")
        hooks.install()
        hooks.on_import("tensorflow", runner._quiet_missing_files)
    if quiet and "quiet" not in _done:
        _done.add("quiet")
        quiet_fd2()
        hooks.on_import("tensorflow", lambda _: quiet_logger())


# The coordinator's records of a closure cut off by a lost task
# (tensorflow/python/distribute/coordinator/cluster_coordinator.py): a lost worker costs only time,
# and a lost ps or `dtf down` ends the call with dtf's one error (dtf.notebook.calls).
CLOSURE_RECORDS = ("Remote function on worker ", "Worker %s failed with ", "Start cancelling closures due to error",
                   " /job:worker/task:%d encountered the following error")
LOST_TASK_ERRORS = ("UnavailableError", "CancelledError", "AbortedError")


class _Noise(logging.Filter):
    """TensorFlow's Python log records that dtf.program.noise drops from a script's stderr, and the
    coordinator's records of closures cut off by a lost task (their long gRPC text, in a cell)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from dtf.program import noise

        message = record.getMessage()
        if str(record.msg).startswith(CLOSURE_RECORDS) and any(e in message for e in LOST_TASK_ERRORS):
            return False
        first = message.split("\n", 1)[0]
        return noise.NoiseFilter().keeps(f"{record.levelname}:{record.name}:{first}")


def quiet_logger() -> None:
    """TensorFlow's Python logger as in a script: WARNING and up, once. In an interactive process
    (IPython's sys.ps1) TensorFlow logs INFO to stdout, and again through the root logger's handler
    where one is added later (tensorflow/python/platform/tf_logging.py, get_logger)."""
    import tensorflow as tf

    logger = tf.get_logger()
    logger.setLevel(logging.WARNING)
    if logger.handlers:
        logger.propagate = False
    logger.addFilter(_Noise())


def quiet_fd2() -> None:
    """Route fd 2 through dtf.program.noise's filter, to where it went before."""
    from dtf.program import noise

    sys.stderr.flush()
    read, write = os.pipe()
    before = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    noise.pump(os.fdopen(read, "rb", buffering=0), os.fdopen(before, "wb", buffering=0))


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance()
    app.log_level = logging.ERROR  # not its notes on the connection (a local one, made by dtf)
    app.initialize(sys.argv[1:])  # type: ignore[no-untyped-call]
    setup(quiet=os.environ.get("DTF_VERBOSE") != "1")
    app.start()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
