"""What `top` measures of each task on its host, from /proc and the kernel's TCP counters: CPU%,
resident memory, and bytes in/out per second of the task's TCP connections.

A task is its supervisor's process group (the supervisor, its server or program copy, their
children): `pid.json`'s pid leads it. CPU% and the byte rates are differences between two samples,
so the first sample of a `top` stream has none (None). Network counts come from `ss -tinp` (the
kernel's tcp_info: bytes_received, bytes_acked per socket, with the owning pids); without `ss` they
are None. Connections opened and closed between two samples are not counted.

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SS_TIMEOUT = 5.0

_PID = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_received|bytes_acked):(\d+)")


@dataclass(frozen=True)
class Usage:
    """One task's counters at one moment (cumulative: rates are differences of two)."""

    cpu_ticks: int  # user + system time of its processes, in clock ticks
    rss: int  # bytes resident
    net_in: int | None  # bytes received on its TCP connections
    net_out: int | None  # bytes sent (acknowledged) on its TCP connections


def processes() -> dict[int, tuple[int, int, int]]:
    """pid -> (process group, cpu ticks, resident bytes) of every process we can read."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
        try:  # fields[0] is stat's 3rd: state; pgrp is the 5th, utime/stime the 14th/15th, rss the 24th
            found[int(name)] = (int(fields[2]), int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE)
        except (IndexError, ValueError):
            continue
    return found


def socket_bytes() -> dict[int, tuple[int, int]] | None:
    """pid -> (bytes received, bytes sent) over its established TCP connections; None without ss."""
    ss = shutil.which("ss") or next((p for p in ("/usr/sbin/ss", "/sbin/ss", "/usr/bin/ss") if os.path.exists(p)), None)
    if ss is None:
        return None
    try:
        out = subprocess.run([ss, "-tinpH"], capture_output=True, text=True, timeout=SS_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    totals: dict[int, tuple[int, int]] = {}
    pids: list[int] = []
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line: its owners
            pids = sorted({int(p) for p in _PID.findall(line)})
            continue
        counters = dict(_COUNTER.findall(line))
        got, sent = int(counters.get("bytes_received", 0)), int(counters.get("bytes_acked", 0))
        for pid in pids[:1]:  # a socket shared by a parent and its child counts once
            a, b = totals.get(pid, (0, 0))
            totals[pid] = (a + got, b + sent)
    return totals


def usage(groups: dict[str, int]) -> dict[str, Usage]:
    """Each task's counters now; `groups`: task -> the pid leading its process group."""
    procs = processes()
    sockets = socket_bytes()
    members: dict[int, list[int]] = {}
    for pid, (pgrp, _, _) in procs.items():
        members.setdefault(pgrp, []).append(pid)
    found = {}
    for task, leader in groups.items():
        pids = members.get(leader, [])
        net = None
        if sockets is not None:
            net = (sum(sockets.get(p, (0, 0))[0] for p in pids), sum(sockets.get(p, (0, 0))[1] for p in pids))
        found[task] = Usage(cpu_ticks=sum(procs[p][1] for p in pids), rss=sum(procs[p][2] for p in pids),
                            net_in=net[0] if net else None, net_out=net[1] if net else None)
    return found


def rates(before: Usage | None, now: Usage, seconds: float) -> tuple[float | None, float | None, float | None]:
    """(CPU %, bytes in per second, bytes out per second) between two samples; None where unknown."""
    if before is None or seconds <= 0:
        return None, None, None

    def per_second(a: int | None, b: int | None) -> float | None:
        return None if a is None or b is None else max(0.0, (b - a) / seconds)

    cpu = max(0.0, (now.cpu_ticks - before.cpu_ticks) / CLK_TCK / seconds * 100)
    return round(cpu, 1), per_second(before.net_in, now.net_in), per_second(before.net_out, now.net_out)


def clock() -> float:
    return time.monotonic()
