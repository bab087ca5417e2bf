"""`python -m dtf.program.runner PROGRAM [ARGS...]`: how `dtf train` runs the user's program.

It installs dtf's hooks in the program's own process before any of the program's code runs
(`dtf.program.hooks`: each feature that must act inside the program, e.g. where checkpoints are written,
lives there), then runs PROGRAM as `__main__` exactly as `python PROGRAM ARGS` would: the same
sys.argv, sys.path[0] the program's directory, `__file__` set. A module runner rather than a
`sitecustomize` on the program's path: that would shadow the user's own sitecustomize.

dtf starts it, and every Python of its own that imports dtf first (a notebook's run, its kernel),
with `python_m`, not `python -m`: `-m` puts the working directory first on sys.path, and a folder
there named `dtf` that is not the package (the clone's own folder, seen from the folder that holds
it; any empty `dtf` folder) is then imported as a namespace package `dtf` (PEP 420): the import
system takes it before the finder of an editable install (`pip install -e`), which setuptools puts
after the path's own. Nothing of dtf's then works (`module 'dtf' has no attribute 'under_dtf'`).
Without the working directory on sys.path, `import dtf` finds the installed package; the program's
own directory, put first afterwards as `python PROGRAM` puts it, comes after dtf is imported.

With DTF_EXIT_STATUS_FILE set (by `dtf train`, and by a copy's supervisor in collective mode), it
writes there the exit code the program ended with, after every atexit function has run: the last
thing Python does before its runtime is torn down. TensorFlow can crash in that teardown
(SIGABRT, "terminate called after throwing ...", seen after a worker was lost and came back, with
the program's work all done); that code then stands, not the signal.

What the program raises and does not catch is printed as Python would print it, less dtf's own
frames (this runner, runpy, the hooks' wrappers): the program's traceback is the program's. Ctrl-C
(KeyboardInterrupt) prints none: the program still ends by SIGINT, and `dtf train` says it was
interrupted. A worker's missing file is said in one line: the workers read their own disks.

With DTF_ERROR_FILE set (by `dtf train`), an error of TensorFlow's that says a connection to the
cluster failed (`connection_error`: UnavailableError and its kin, a lost ps or a lost network) is
written there, traceback and all, instead of to stderr: `dtf train` decides whether it was the
program's (then it prints it) or the cluster's or the network's (then one line says what happened,
and the program runs again from its last checkpoint).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import runpy
import sys
import traceback
from types import ModuleType, TracebackType

from dtf_server.protocol import EXIT_STATUS_ENV


def exit_code(code: object) -> int:
    """The process exit code of `SystemExit(code)`, as Python computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, exit code 1


# `python -m MODULE ARGS` less the working directory on sys.path (see the module's docstring): the
# empty first entry of `python -c` removed, then runpy runs the module as `-m` would.
_BOOT = ("import runpy, sys\n"
         "if sys.path[:1] == ['']: del sys.path[0]\n"
         "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_m(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command that runs `python -m MODULE ARGS` without the working directory on sys.path."""
    return [python, "-c", _BOOT, module, *args]


ERROR_FILE_ENV = "DTF_ERROR_FILE"
# TensorFlow's error codes (tensorflow/core/protobuf/error_codes.proto) that say a connection to a
# task failed, not the program: UNAVAILABLE (a task or its network gone), DEADLINE_EXCEEDED (a call
# no answer came to), ABORTED (a call a restarted task dropped).
CONNECTION_CODES = {14: "UNAVAILABLE", 4: "DEADLINE_EXCEEDED", 10: "ABORTED"}
# INVALID_ARGUMENT with these words: a task's eager context was made anew under the program (the
# coordinator reconnects to the cluster after it took workers for lost, as it does once this machine's
# network comes back), and the ps no longer knows the program's variables. ClusterCoordinator counts it
# as a ps failure too (cluster_coordinator.py: _is_ps_failure).
CONTEXT_GONE = ("Unable to find the relevant tensor remote_handle", "unknown device")

_error_file: list[str | None] = [None]  # where a connection error goes (ERROR_FILE_ENV, read at the start)
# The program's path, for excepthook: by then python_m's runpy has put its own sys.argv[0] back.
_program: list[str | None] = [None]
_DTF_DIR = os.path.dirname(os.path.abspath(__file__))  # dtf.program: this runner and the hooks
_RUNPY = {os.path.abspath(runpy.__file__), "<frozen runpy>"}
_NO_FILE = re.compile(r"(\S+?)\s*[;:]?\s*No such file or directory")


def _dtf_frame(frame: traceback.FrameSummary) -> bool:
    path = frame.filename if frame.filename.startswith("<") else os.path.abspath(frame.filename)
    return path in _RUNPY or path.startswith(_DTF_DIR + os.sep)


def _trim(exc: traceback.TracebackException) -> None:
    """Drop dtf's frames from `exc` and the exceptions chained to it, unless the error is raised
    in dtf's own code (then every frame tells where)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.stack and not _dtf_frame(e.stack[-1]):
            frames = list(e.stack)
            if len(frames) > 1 and frames[0].filename == "<string>" and _dtf_frame(frames[1]):
                frames = frames[1:]  # python_m's bootstrap, which runpy's frames follow
            e.stack = traceback.StackSummary.from_list([f for f in frames if not _dtf_frame(f)])
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def missing_on_worker(value: BaseException) -> str | None:
    """One line for TensorFlow's "No such file or directory" raised on a worker, else None."""
    if not type(value).__module__.startswith("tensorflow") or "/job:worker" not in str(value):
        return None
    match = _NO_FILE.search(str(value))
    if match is None:
        return None
    return (f"a worker could not open {match.group(1)}: No such file or directory. The workers read their "
            f"own disks, not this machine's: copy the data to them with `dtf sync DIR` and open it in the "
            f"program at `dtf.synced(NAME)` (or give a path that exists on every worker)")


class _MissingOnWorker(logging.Filter):
    """Drops the coordinator's logs of a worker's missing file (the error with its definition's
    traceback, logged per failed closure and again as closures are cancelled:
    tensorflow/python/distribute/coordinator/cluster_coordinator.py): the error itself reaches the
    program, and `excepthook` says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("/job:worker" in message and "No such file or directory" in message)


def _quiet_missing_files(_: ModuleType) -> None:
    logging.getLogger("tensorflow").addFilter(_MissingOnWorker())


def connection_error(value: BaseException) -> bool:
    """Whether `value`, or an exception it was raised from, is TensorFlow's word that a connection
    to a task failed (CONNECTION_CODES)."""
    seen: set[int] = set()
    e: BaseException | None = value
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith("tensorflow"):
            code = getattr(e, "error_code", None)
            if code in CONNECTION_CODES or (code == 3 and any(w in str(e) for w in CONTEXT_GONE)):
                return True
        e = e.__cause__ or e.__context__
    return False


def error_line(value: BaseException) -> str:
    """`value` in one line: its type and the first line of its message that says something
    (TensorFlow's begin with "Graph execution error:" and where the op was defined)."""
    for line in str(value).splitlines():
        line = line.strip()
        if line and line != "Graph execution error:" and not line.startswith(("Detected at node", "File ")):
            return f"{type(value).__name__}: {line[:200].split('. ')[0].rstrip('.')}"
    return type(value).__name__


def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """sys.excepthook for the program: see the module's docstring."""
    if issubclass(kind, KeyboardInterrupt):
        return
    exc = traceback.TracebackException(kind, value, tb)
    _trim(exc)
    error_file = _error_file[0]
    if error_file and connection_error(value):
        try:
            with open(error_file, "w") as f:
                json.dump({"error": error_line(value), "traceback": "".join(exc.format())}, f)
            return
        except OSError:
            pass  # said here, as without the file
    line = missing_on_worker(value)
    if line is not None:
        where = [f for f in exc.stack if os.path.abspath(f.filename) == _program[0]]
        at = f" ({os.path.basename(where[-1].filename)}:{where[-1].lineno})" if where else ""
        print(f"dtf: error: {line}{at}", file=sys.stderr, flush=True)
        return
    print("".join(exc.format()), end="", file=sys.stderr, flush=True)


def _write_status(path: str, outcome: dict[str, int | None]) -> None:
    if outcome["code"] is None:  # KeyboardInterrupt: Python ends by SIGINT, which is the truth
        return
    try:
        with open(path, "w") as f:
            f.write(f"{outcome['code']}\n")
    except OSError:
        pass  # dtf train then reports the signal, as without this file


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m dtf.program.runner PROGRAM [ARGS...]")
    program, args = sys.argv[1], sys.argv[2:]
    outcome: dict[str, int | None] = {"code": 1}  # an uncaught exception, unless we learn otherwise
    status_path = os.environ.pop(EXIT_STATUS_ENV, None)  # not the program's children's business
    _error_file[0] = os.environ.pop(ERROR_FILE_ENV, None)
    _program[0] = os.path.abspath(program)
    if status_path:
        atexit.register(_write_status, status_path, outcome)  # registered first: runs last
    from dtf.program import hooks
    from dtf.program.hooks import oncluster

    hooks.install()
    hooks.on_import("tensorflow", _quiet_missing_files)
    sys.excepthook = excepthook
    sys.argv = [program, *args]
    # The program's directory first, as `python PROGRAM` has it; under `python -m` (by hand), in
    # place of the working directory.
    if sys.path[:1] == [os.getcwd()]:
        del sys.path[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
    try:
        try:
            runpy.run_path(program, run_name="__main__")
        except SystemExit as e:
            if exit_code(e.code) != 0:
                raise
            # `sys.exit(0)` / `sys.exit(main())`: a normal end, checked as one
        oncluster.check_at_end()
    except SystemExit as e:
        outcome["code"] = exit_code(e.code)
        raise
    except KeyboardInterrupt:
        outcome["code"] = None
        raise
    outcome["code"] = 0


if __name__ == "__main__":
    main()
