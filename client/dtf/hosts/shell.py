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


def expand_local(argv: Sequence[str]) -> list[str]:
    """What the remote shell would do to `argv` with render(): expand a leading ~/ here."""
    return [os.path.expanduser(a) if a == "~" or a.startswith("~/") else a for a in argv]
