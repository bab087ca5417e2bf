"""Remote commands are argv lists; this is the one place they become shell text.

Every argument is quoted with shlex, so no inventory value (a path with spaces, quotes, `;` or
`$(...)`) is ever executed by the remote shell. The one exception is a leading `~/`, left bare so
the remote shell expands it to that user's home (`~/'my dir'` is a home-relative path).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence


def quote_arg(arg: str) -> str:
    if arg == "~":
        return "~"
    if arg.startswith("~/"):
        return "~/" + shlex.quote(arg[2:]) if len(arg) > 2 else "~/"
    return shlex.quote(arg)


def render(argv: Sequence[str]) -> str:
    """The shell command line that runs exactly `argv` on the remote host."""
    return " ".join(quote_arg(a) for a in argv)


def render_with(argv: Sequence[str], variables: dict[str, str]) -> str:
    """render(), where each text in `variables` (a placeholder) becomes a reference to the shell
    variable it names, wherever it occurs in an argument: the command of a plan whose values only
    the remote shell learns (a Slurm allocation's job id, node names and addresses, known to the
    login host's command before they come back here)."""
    import re

    found = re.compile("(" + "|".join(re.escape(text) for text in variables) + ")")

    def one(arg: str) -> str:
        parts = found.split(arg)  # literal, placeholder, literal, ...
        if len(parts) == 1:
            return quote_arg(arg)
        return "".join(f'"${{{variables[part]}}}"' if i % 2 else
                       (quote_arg(part) if i == 0 else shlex.quote(part)) if part else ""
                       for i, part in enumerate(parts))

    return " ".join(one(a) for a in argv)


def expand_local(argv: Sequence[str]) -> list[str]:
    """What the remote shell would do to `argv` with render(): expand a leading ~/ here."""
    return [os.path.expanduser(a) if a == "~" or a.startswith("~/") else a for a in argv]
