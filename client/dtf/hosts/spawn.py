"""An OpenSSH master's process: started (`start`, for dtf.hosts.tunnel.Master), asked whether it
answers (`listening`) and closed (`stop`)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time

from dtf.hosts import mux

STOP_WAIT = 5.0  # seconds a master has to exit after `-O exit`


def listening(path: str) -> bool:
    """Whether a master answers on the socket (a connect, no process started)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _wait_exited(pid: int, timeout: float) -> bool:
    """Until process `pid` has ended (or is a zombie, where /proc says so); False at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except (OSError, IndexError):
            pass
        time.sleep(0.02)
    return False


def stop(ssh: str, path: str) -> None:
    """Close the master at `path` and wait until it has exited (a hop's carries the hosts' until
    they have); its socket is removed. Asked of the master itself (dtf.hosts.mux: `dtf down`
    closes one per host, and two ssh processes each were most of its CPU here), else, where it
    does not take that or DTF_SSH_MUX=0, with `ssh -O check` and `ssh -O exit`."""
    pid: int | None = None
    if mux.enabled() and listening(path):
        with contextlib.suppress(mux.MuxRefused):
            pid = mux.terminate(path)
    if pid is None:
        pid = _stop_by_ssh(ssh, path)
    if pid is not None:
        _wait_exited(pid, STOP_WAIT)
    try:
        os.unlink(path)
    except OSError:
        pass


def _stop_by_ssh(ssh: str, path: str) -> int | None:
    """`ssh -O exit` to the master at `path`: its process id once it agreed to exit, else None."""

    def control(command: str) -> str | None:
        try:
            # The host argument is required and ignored: the socket names the master.
            r = subprocess.run([ssh, "-S", path, "-O", command, "dtf-host"], capture_output=True, text=True,
                               timeout=10, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stderr + r.stdout if r.returncode == 0 else None

    checked = control("check") if listening(path) else None
    m = re.search(r"pid=(\d+)", checked or "")
    return int(m.group(1)) if m and control("exit") is not None else None


def start(argv: list[str], path: str) -> subprocess.Popen[bytes]:
    """Start a master's ssh (`-N -f` in `argv`: it exits once the master runs, or failed) with its
    control socket at `path` and its stderr in `path`.log: a file, not a pipe, for the master that
    `-f` leaves behind keeps it open. A dead master's socket at `path` is removed first: ssh would
    not replace it, and would run unshared."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with open(path + ".log", "w") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
