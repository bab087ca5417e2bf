"""The programs dtf runs on hosts: package data (`scripts/` beside the modules that run them), sh
and Python files that `make lint` checks (shellcheck, ruff), read here as the text a command
carries (`sh -c TEXT`, `python -c TEXT`)."""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def script(name: str, package: str = "dtf.hosts") -> str:
    """The text of the program `name` in `package`'s scripts/ folder, without its leading comment
    (its documentation and shellcheck's directives, which need not travel with every command)."""
    lines = (resources.files(package) / "scripts" / name).read_text(encoding="utf-8").splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)
