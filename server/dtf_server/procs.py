"""Process and file helpers of the launcher: which process is ours, ports, logs, JSON files.

A pid is only ever signalled if its start time (from /proc) still matches the one recorded when
dtf started it: dtf never kills a process it did not start, even after pid reuse.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
from typing import Any, NoReturn


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has finished; only its parent's wait is missing
        return None
    return int(fields[19])


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def ours(record: dict[str, Any] | None) -> bool:
    """True if the process recorded in a pid.json is alive and is the one we started."""
    if not record:
        return False
    return bool(proc_start_ticks(record["pid"]) == record["start_ticks"])


def server_record(sup: dict[str, Any]) -> dict[str, Any] | None:
    """The server a supervisor.json names, as a record `ours` checks (None: no server now)."""
    if not sup.get("server_pid"):
        return None
    return {"pid": sup["server_pid"], "start_ticks": sup.get("server_ticks")}


def port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like gRPC: SO_REUSEADDR, so a port left in TIME_WAIT by a stopped server counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))  # a TF server listens on every address (grpc_server_lib.cc)
            return False
        except OSError:
            return True


def port_open(port: int, timeout: float = 0.5) -> bool:
    """Whether a connection to this host's `port` (127.0.0.1) is accepted within `timeout`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(("127.0.0.1", port))
            return True
        except OSError:
            return False


def tail(path: str, lines: int = 20) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a supervisor's child, before exec: be killed when the supervisor dies, however it dies
    (Linux's PR_SET_PDEATHSIG), so a server never outlives the process that answers for it.
    `sig`: the signal it gets then (a supervisor of a Slurm step's launcher: TERM, to stop its
    server)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):  # not Linux, or no prctl: the supervisor's TERM still stops it
        pass


def leave(code: int) -> NoReturn:
    """A forked child's end (a supervisor's, a server's): its output flushed, then os._exit, never
    a return into the code it was forked from, nor the parent's atexit handlers and buffers (which
    the fork copied: they are the parent's to run and flush, once)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code)


def name_process(name: str) -> None:
    """What `ps -e` and top call this process (its comm, 15 characters at most)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def settle_child(cwd: str, name: str) -> None:
    """A forked child's start, as a process of its own would begin: stdin from /dev/null, no
    descriptor above stderr (the SSH session's pipes above all: it must end without the child),
    `cwd` its directory, `name` its comm."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    close_inherited()
    os.chdir(cwd)
    name_process(name)


def close_inherited() -> None:
    """Close every descriptor above stderr: those open (/proc/self/fd), else a range of them."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        os.closerange(3, 65536)
        return
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:  # (the listing's own, closed already)
                pass


def log_line(message: str) -> None:
    """One line in the task's log (the supervisor's stdout is the log)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} dtf: {message}", flush=True)


# One directory per GPU that the NVIDIA driver knows (its PCI address), whether or not a cgroup
# lets this process use it: a count that needs neither nvidia-smi nor CUDA. DTF_NVIDIA_GPUS_DIR
# stands in for it in the tests (hosts without GPUs).
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def nvidia_gpus() -> int | None:
    """How many GPUs the host's NVIDIA driver lists; None where it has no NVIDIA driver."""
    try:
        return len(os.listdir(os.environ.get("DTF_NVIDIA_GPUS_DIR") or NVIDIA_GPUS_DIR))
    except OSError:
        return None


def platform_info() -> tuple[str, str, str]:
    """(machine, system, libc): what picks this host's wheels, e.g. ("x86_64", "Linux", "glibc 2.36"):
    platform.machine() and platform.system() from os.uname(), and the C library's own answer to
    what platform.libc_ver() guesses by reading the python binary."""
    uname = os.uname()
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; not glibc: none
    except (ValueError, OSError, AttributeError):
        libc = ""
    return uname.machine, uname.sysname, libc if len(libc.split()) == 2 else ""


def expand_home(argv: list[str]) -> list[str]:
    """What a shell does to a leading ~/ (the plan writes host paths that way)."""
    return [os.path.expanduser(a) if a == "~" or a.startswith("~/") else a for a in argv]


def variables(pairs: list[str]) -> dict[str, str]:
    """NAME=VALUE pairs (a command's `--env`) as a mapping."""
    found: dict[str, str] = {}
    for pair in pairs:
        name, value = pair.split("=", 1)
        found[name] = value
    return found


def launcher() -> str:
    """This launcher's file (the zipapp python was asked to run)."""
    return os.path.abspath(sys.argv[0])
