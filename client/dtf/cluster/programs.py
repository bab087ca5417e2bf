"""The programs dtf runs on hosts and on a Slurm login host: package data in dtf/cluster/scripts,
sh and Python files that `make lint` checks (shellcheck, ruff), read here as the text a command
carries (`sh -c TEXT`, `python -c TEXT`)."""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def script(name: str) -> str:
    """The text of a program in dtf/cluster/scripts, without its leading comment (its documentation
    and shellcheck's directives, which need not travel with every command)."""
    lines = (resources.files("dtf.cluster") / "scripts" / name).read_text(encoding="utf-8").splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)
