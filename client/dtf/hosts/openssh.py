"""The OpenSSH client's command line for a host, as the inventory and ssh_config say, and what
OpenSSH resolves for it (`settings`: `ssh -G`, the HostName it connects to and its ProxyJump).

Below both `control` (the runner of a host over its master) and
`tunnel` (which runs SSH masters): neither imports the other for it.
"""

from __future__ import annotations

import os
import shutil
import threading

from dtf.cluster.inventory import HostSpec

SSH_ENV = "DTF_SSH"  # the ssh client to use (a path), or "none" for the pure-Python fallback
ALIVE_INTERVAL = 15  # ServerAliveInterval: seconds between SSH keepalives (NAT idle timeouts)
ALIVE_COUNT = 3  # ServerAliveCountMax: unanswered keepalives before ssh gives up on the host


def ssh_binary() -> str | None:
    """The OpenSSH client to carry connections, or None: use the Python fallback."""
    chosen = os.environ.get(SSH_ENV)
    if chosen:
        return None if chosen == "none" else chosen
    return shutil.which("ssh")


def ssh_argv(ssh: str, spec: HostSpec, ssh_config: str | None, connect_timeout: float,
             *options: str, alive: int = ALIVE_INTERVAL) -> list[str]:
    """An OpenSSH command line for `spec`, as the inventory and ssh_config say (`alive`: seconds
    between keepalives; ALIVE_COUNT unanswered ones end the connection)."""
    argv = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(connect_timeout))}",
            "-o", f"ServerAliveInterval={alive}", "-o", f"ServerAliveCountMax={ALIVE_COUNT}"]
    if ssh_config:
        argv += ["-F", os.path.expanduser(ssh_config)]
    if spec.user:
        argv += ["-l", spec.user]
    if spec.port:
        argv += ["-p", str(spec.port)]
    if spec.identity_file:
        argv += ["-i", os.path.expanduser(spec.identity_file)]
    return [*argv, *options, spec.host]


# OpenSSH's settings for a host, as `ssh -G` prints them: (argv) -> (when read, {key: first value}).
_settings: dict[tuple[str, ...], tuple[float, dict[str, str]]] = {}
SETTINGS_FOR = 60.0  # seconds a host's settings are reused (an `up`'s plan and its masters ask the same)
SETTINGS_TIMEOUT = 10.0  # seconds `ssh -G` gets (it reads files; a `Match exec` may run a command)
_lock = threading.Lock()
_inflight: dict[tuple[str, ...], threading.Event] = {}  # `ssh -G` command lines running, to their end


def _settings_argv(ssh: str, spec: HostSpec, ssh_config: str | None) -> tuple[str, ...]:
    """`ssh -G`'s command line for the host, and (the cache's key) the config file's mtime."""
    config = os.path.expanduser(ssh_config or "~/.ssh/config")
    try:
        changed = str(os.stat(config).st_mtime_ns)
    except OSError:
        changed = "-"
    return (*ssh_argv(ssh, spec, ssh_config, 10, "-G"), changed)


def prefetch(ssh: str, specs: list[HostSpec], ssh_config: str | None) -> None:
    """Read the settings of every host at once (one `ssh -G` each, side by side), for `settings`.
    A host whose `ssh -G` another thread runs (a master's jump hosts, asked side by side) is waited
    for, not asked again."""
    import subprocess
    import time

    now = time.monotonic()
    wanted = {argv for argv in (_settings_argv(ssh, spec, ssh_config) for spec in specs)
              if argv not in _settings or now - _settings[argv][0] > SETTINGS_FOR}
    with _lock:
        theirs = {argv: _inflight[argv] for argv in wanted if argv in _inflight}
        mine = wanted - theirs.keys()
        done = threading.Event()
        _inflight.update(dict.fromkeys(mine, done))
    try:
        procs = {}
        for argv in mine:
            try:
                procs[argv] = subprocess.Popen(argv[:-1], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL, text=True)
            except OSError:
                continue
        deadline = time.monotonic() + SETTINGS_TIMEOUT
        for argv, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                continue
            if proc.returncode == 0:
                _settings[argv] = (now, _parse(out))
    finally:
        with _lock:
            for argv in mine:
                _inflight.pop(argv, None)
        done.set()
    for event in set(theirs.values()):
        event.wait(SETTINGS_TIMEOUT)


def _parse(out: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        found.setdefault(key.lower(), value.strip())
    return found


def settings(ssh: str, spec: HostSpec, ssh_config: str | None) -> dict[str, str]:
    """OpenSSH's settings for the host (`ssh -G`: ssh_config resolved, no network; the first value
    of each key, keys in lower case): what OpenSSH will connect to (hostname, user, port,
    proxyjump). {} where ssh cannot say. Reused for SETTINGS_FOR seconds."""
    argv = _settings_argv(ssh, spec, ssh_config)
    import time

    if argv not in _settings or time.monotonic() - _settings[argv][0] > SETTINGS_FOR:
        prefetch(ssh, [spec], ssh_config)
    return _settings[argv][1] if argv in _settings else {}
