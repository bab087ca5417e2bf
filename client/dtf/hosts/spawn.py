"""An OpenSSH master's process: started (`start`, for dtf.hosts.tunnel.Master), and the ones begun
before dtf has loaded, from what the last `dtf up` of the same inventory ran (`begin`).

`dtf up` waits first on SSH handshakes (0.2-0.3 s each on the lab): to each host, or to a Slurm
inventory's login host. Begun by `up` itself, they start once the CLI has loaded, read the
inventory and planned (0.15-0.3 s after the command started). So every master an `up` starts
(or takes over) is recorded (`record`, by tunnel.Master), and at the command's end remembered
(`keep`): its command line and control path, under the inventory file's size, mtime and inode,
and the --connect-timeout and --ttl given, in DTF_HOME/masters.json. The next plain `dtf up` of
the unchanged file starts those command lines at once (`begin`, with no module of dtf loaded but
this one; at most `at_once()` of them, the hosts `up` starts at once), and the master that `up`
then asks for at each control path takes its ssh over (`take`) when it would run the same command
line. One that would run another (ssh_config now names a ProxyJump, dtf changed its options) ends
the early one, and the master it made, first: what starts early never outlives a command that
did not take it (`abandon`, on the way out of dtf.entry), and never becomes a cluster's master
unless `up` would have started exactly it.

Standard library only (os, json; subprocess and socket only when used): this runs before the rest.
"""

from __future__ import annotations

import json
import os
import time

TYPE_CHECKING = False  # (typing's, without its import)
if TYPE_CHECKING:
    import subprocess

CACHE = "masters.json"
OLD_CACHE = "login-masters.json"  # (dtf's own, before it remembered every host's master: removed)
STOP_WAIT = 5.0  # seconds a master has to exit after `-O exit`
# Hosts at once in the steps of many hosts where a host waits for nothing but itself (`up`'s start,
# status, stop...: dtf.hostops.parallel); DTF_TURNS changes it. Also the most masters begun early.
TURNS = 32

_pending: dict[str, tuple[list[str], subprocess.Popen[bytes]]] = {}  # control path -> begun, not taken
_begun: set[str] = set()  # control paths whose master this process began early (taken or not)
_started: dict[str, list[str]] = {}  # control path -> the command line of a master started (or taken) here
_for: tuple[str, float | None, float | None] | None = None  # the `up` begun: (inventory, timeout, ttl)


def at_once() -> int:
    """How many hosts at once (TURNS, or DTF_TURNS)."""
    value = os.environ.get("DTF_TURNS", "")
    return int(value) if value.isdigit() and int(value) > 0 else TURNS


def cache_path(name: str = CACHE) -> str:
    """DTF_HOME/masters.json (dtf.cluster.state.home(), without that module's imports)."""
    return os.path.join(os.path.expanduser(os.environ.get("DTF_HOME") or "~/.dtf"), name)


def listening(path: str) -> bool:
    """Whether a master answers on the socket (a connect, no process started)."""
    if not os.path.exists(path):
        return False
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def answering(path: str) -> bool:
    """Whether the master at `path` answers and is the cluster's: not one begun early that no
    Master took yet (it answers once its handshake is over: `pending`)."""
    return listening(path) and not pending(path)


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
    they have); its socket is removed."""
    import re
    import subprocess

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
    if m and control("exit") is not None:
        _wait_exited(int(m.group(1)), STOP_WAIT)
    try:
        os.unlink(path)
    except OSError:
        pass


def start(argv: list[str], path: str) -> subprocess.Popen[bytes]:
    """Start a master's ssh (`-N -f` in `argv`: it exits once the master runs, or failed) with its
    control socket at `path` and its stderr in `path`.log: a file, not a pipe, for the master that
    `-f` leaves behind keeps it open. A dead master's socket at `path` is removed first: ssh would
    not replace it, and would run unshared."""
    import subprocess

    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with open(path + ".log", "w") as err:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def _stat(inventory: str) -> list[int] | None:
    try:
        st = os.stat(inventory)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _load() -> dict[str, dict[str, object]]:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remembered(inventory: str, connect_timeout: float | None, ttl: float | None) -> list[tuple[list[str], str]]:
    """The masters remembered for this inventory file, if it is unchanged and `up` is given the
    same --connect-timeout and --ttl (else none): (command line, control path), in order."""
    entry = _load().get(os.path.realpath(inventory))
    if not isinstance(entry, dict) or entry.get("stat") != _stat(inventory):
        return []
    if entry.get("connect_timeout") != connect_timeout or entry.get("ttl") != ttl:
        return []
    masters = entry.get("masters")
    found: list[tuple[list[str], str]] = []
    for item in masters if isinstance(masters, list) else []:
        argv, path = item if isinstance(item, list) and len(item) == 2 else (None, None)
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv) and isinstance(path, str)):
            return []
        found.append((argv, path))
    return found


def begin(inventory: str, connect_timeout: float | None, ttl: float | None) -> None:
    """Start the masters the last `up` of this inventory file started (see the module's doc), if
    the file is unchanged and `up` is given the same --connect-timeout and --ttl: the first
    `at_once()` of them, each unless a master answers at its control path already (a cluster that
    is up keeps its own). What this `up` starts is remembered for the next (`keep`)."""
    global _for
    _for = (inventory, connect_timeout, ttl)
    for argv, path in _remembered(inventory, connect_timeout, ttl)[:at_once()]:
        if path in _pending or listening(path):
            continue
        try:
            proc = start(argv, path)
        except OSError:  # (no ssh there any more: `up` says so itself)
            return
        _pending[path] = (argv, proc)
        _begun.add(path)


def pending(path: str) -> bool:
    """Whether a master begun early at `path` waits to be taken (`take`): it answers there once its
    handshake is over, but is not the cluster's until a Master that would run the same took it."""
    return path in _pending


def begun(path: str) -> bool:
    """Whether this process began the master at `path` early (it is this process's to close)."""
    return path in _begun


def take(path: str, argv: list[str] | None) -> subprocess.Popen[bytes] | None:
    """The ssh begun early at `path`, if it runs `argv` (None: what is to run there is not known
    yet: it is ended), for the caller to wait on as its own; one that runs another command line is
    ended, the master it made closed, and None returned: the caller starts its own."""
    begun_early = _pending.pop(path, None)
    if begun_early is None:
        return None
    if begun_early[0] == argv:
        return begun_early[1]
    _end(path, *begun_early)
    return None


def _end(path: str, argv: list[str], proc: subprocess.Popen[bytes]) -> None:
    """End an early master: its ssh (still in its handshake, or gone once the master runs), then
    the master it left, if any (`stop`), and its log."""
    import subprocess

    try:
        proc.wait(timeout=0.2)
    except subprocess.TimeoutExpired:  # still in its handshake: no master yet
        proc.kill()
        proc.wait()
    stop(argv[0], path)
    try:
        os.unlink(path + ".log")
    except OSError:
        pass


def abandon() -> None:
    """End every master begun early that no `up` took (the command is over)."""
    while _pending:
        path, begun_early = _pending.popitem()
        _end(path, *begun_early)


def record(path: str, argv: list[str]) -> None:
    """A master this command starts at `path` with `argv` (its own ssh, or one begun early that it
    takes over), for `keep` to remember."""
    _started[path] = argv


def keep() -> None:
    """The command is over: remember the masters it started for the `up` begun (if any did), for
    the next `up` of the same inventory to begin; with those remembered before for the same
    file and options, where they stay in their place (a repair starts only the masters that had
    gone)."""
    if _for is None or not _started:
        return
    masters = {path: argv for argv, path in _remembered(*_for)}
    masters.update(_started)
    remember(*_for, [(argv, path) for path, argv in masters.items()])


def remember(inventory: str, connect_timeout: float | None, ttl: float | None,
             masters: list[tuple[list[str], str]]) -> None:
    """Keep the command lines and control paths of the masters an `up` of this inventory started,
    in the order it started them, for the next `up` of the same file to `begin` (written whole,
    then renamed: a reader never sees half)."""
    stat = _stat(inventory)
    if stat is None:
        return
    data = _load()
    data[os.path.realpath(inventory)] = {"stat": stat, "connect_timeout": connect_timeout, "ttl": ttl,
                                         "masters": [[argv, path] for argv, path in masters]}
    cache = cache_path()
    tmp = f"{cache}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(data, f)
        os.replace(tmp, cache)
    except OSError:  # a cache: `up` goes on without it
        try:
            os.unlink(tmp)
        except OSError:
            pass
    try:
        os.unlink(cache_path(OLD_CACHE))
    except OSError:
        pass
