"""Durations as dtf's command line writes them (`dtf up --ttl 30m`): pure."""

from __future__ import annotations

import re

from dtf.errors import UsageError

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, option: str) -> float:
    """'90', '90s', '30m', '2h', '1d' in seconds; '0' or 'never' is 0 (no limit). UsageError
    naming `option` otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip().lower())
    if text.strip().lower() == "never":
        return 0.0
    if not m:
        raise UsageError(f"{option}: expected a duration like 90s, 30m, 2h or 0 (never), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]
