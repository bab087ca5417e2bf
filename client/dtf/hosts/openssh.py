"""The OpenSSH client's command line for a host, as the inventory and ssh_config say.

Below both `transport` (which streams `dtf sync`'s bytes through `ssh` when there is one) and
`tunnel` (which runs SSH masters): neither imports the other for it.
"""

from __future__ import annotations

import os
import shutil

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
