"""`python -m dtf.program.runner PROGRAM [ARGS...]`: how `dtf train` runs the user's program.

It installs dtf's hooks in the program's own process before any of the program's code runs
(`dtf.program.hooks`: each feature that must act inside the program, e.g. where checkpoints are written,
lives there), then runs PROGRAM as `__main__` exactly as `python PROGRAM ARGS` would: the same
sys.argv, sys.path[0] the program's directory, `__file__` set. A module runner rather than a
`sitecustomize` on the program's path: that would shadow the user's own sitecustomize.

With DTF_EXIT_STATUS_FILE set (by `dtf train`, and by a copy's supervisor in collective mode), it
writes there the exit code the program ended with, after every atexit function has run: the last
thing Python does before its runtime is torn down. TensorFlow can crash in that teardown
(SIGABRT, "terminate called after throwing ...", seen after a worker was lost and came back, with
the program's work all done); that code then stands, not the signal.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

from dtf_server.procs import EXIT_STATUS_ENV


def exit_code(code: object) -> int:
    """The process exit code of `SystemExit(code)`, as Python computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, exit code 1


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
    if status_path:
        atexit.register(_write_status, status_path, outcome)  # registered first: runs last
    from dtf.program import hooks

    hooks.install()
    sys.argv = [program, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as e:
        outcome["code"] = exit_code(e.code)
        raise
    except KeyboardInterrupt:
        outcome["code"] = None
        raise
    outcome["code"] = 0


if __name__ == "__main__":
    main()
