"""`python -m dtf.runner PROGRAM [ARGS...]`: how `dtf train` runs the user's program.

It installs dtf's hooks in the program's own process before any of the program's code runs
(`dtf.hooks`: each feature that must act inside the program, e.g. where checkpoints are written,
lives there), then runs PROGRAM as `__main__` exactly as `python PROGRAM ARGS` would: the same
sys.argv, sys.path[0] the program's directory, `__file__` set. A module runner rather than a
`sitecustomize` on the program's path: that would shadow the user's own sitecustomize.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m dtf.runner PROGRAM [ARGS...]")
    program, args = sys.argv[1], sys.argv[2:]
    from dtf import hooks

    hooks.install()
    sys.argv = [program, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(program))
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
