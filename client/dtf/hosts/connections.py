"""Which engine reaches a host, decided here and nowhere else, and the SSH connections one cluster
keeps: `Connections`.

- `connection: local`: processes of this machine (LocalRunner, dtf.hosts.local).
- SSH, where this machine has OpenSSH's client: every command, stream, file and port forward over
  the host's master, kept for the cluster's life (OpenSSHRunner, dtf.hosts.control).
- SSH, where it has none (`ssh` not on the PATH, or DTF_SSH=none): paramiko (ParamikoRunner,
  dtf.hosts.paramikossh), a handshake per connection.

Each host's TF address (`resolver`) and the inventory's ssh_config (`check_ssh_config`) are read
by the engine that connects. The providers (dtf.providers) build one `Connections` per cluster
and ask it for runners and for the training's route; nothing above them asks which engine it is.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf.cluster.inventory import HostSpec, Position
from dtf.hosts.base import CommandRunner
from dtf.hosts.local import LocalRunner
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.hosts.openssh import ssh_binary

if TYPE_CHECKING:
    from dtf.hosts.masters import Master
    from dtf.hosts.tunnel import Tunnel, WayBackFactory


@dataclass(frozen=True)
class Connections:
    """The SSH connections of one cluster (`home`: this machine's DTF_HOME, which keys the masters
    with the cluster's name): the engine of each host and the masters kept for the cluster's life."""

    home: Path
    cluster: str
    ssh_config: str | None = None
    connect_timeout: float = CONNECT_TIMEOUT

    def runner(self, spec: HostSpec, ttl: float = 0) -> CommandRunner:
        """The host's runner: local processes, the host's master (kept `ttl` seconds after its last
        use: the cluster's lease), or paramiko."""
        if spec.local:
            return LocalRunner(spec)
        master = self.master(spec, ttl)
        if master is None:
            from dtf.hosts.paramikossh import ParamikoRunner

            return ParamikoRunner(spec, self.ssh_config, self.connect_timeout)
        from dtf.hosts.control import OpenSSHRunner

        return OpenSSHRunner(master)

    def master(self, spec: HostSpec, ttl: float = 0, session: bool = False) -> Master | None:
        """The cluster's OpenSSH master to the host (not started); None where there is no `ssh`.
        `session`: it runs the empty session when it starts (dtf.hosts.masters: TCP_NODELAY)."""
        ssh = ssh_binary()
        if ssh is None:
            return None
        from dtf.hosts.control import cluster_master

        return cluster_master(ssh, spec, self.home, self.cluster, self.ssh_config, self.connect_timeout, ttl,
                              session=session)

    def converses(self, spec: HostSpec) -> bool:
        """Whether the host's commands can keep their stdin open while their output is read (an
        OpenSSH master's sessions: CommandRunner.converse)."""
        return spec.connection == "ssh" and ssh_binary() is not None

    def tunnel(self, hosts: Sequence[tuple[HostSpec, Sequence[str]]], ttl: dict[str, float],
               way_back: WayBackFactory | None = None) -> Tunnel:
        """The training's route to the tasks through SSH (dtf.hosts.tunnel): `hosts` each with its
        tasks' addresses, over the cluster's masters (`ttl`: each host's lease), or paramiko."""
        from dtf.hosts.tunnel import Tunnel

        def shared(spec: HostSpec) -> Master:
            master = self.master(spec, ttl.get(spec.host, 0), session=True)
            assert master is not None
            return master

        return Tunnel(hosts, self.ssh_config, self.connect_timeout, way_back=way_back,
                      shared=shared if ssh_binary() is not None else None)

    def close(self) -> int:
        """Close every master of the cluster; how many ran."""
        from dtf.hosts.control import close_control

        return close_control(self.home, self.cluster)


def resolver(ssh_config: str | None, specs: Sequence[HostSpec] = ()) -> Callable[[HostSpec], str]:
    """A function giving each host's TF address: `address` key, else ssh_config's HostName. Read
    by OpenSSH where there is an `ssh` (the one that connects: `ssh -G`, every host of `specs` at
    once, and the same settings its master reads for its jump hosts), else by paramiko, whose
    import would slow every `up`'s start before any host is reached."""
    from dtf.hosts.openssh import prefetch, settings

    ssh = ssh_binary()
    if ssh is not None:
        prefetch(ssh, [spec for spec in specs if spec.connection == "ssh" and not spec.address], ssh_config)
    parsed: list[Any] = []  # the inventory's ssh_config, read once for every host

    def resolve(spec: HostSpec) -> str:
        if spec.address:
            return spec.address
        if spec.local:
            return "127.0.0.1"
        if ssh is not None and spec.connection == "ssh":
            return settings(ssh, spec, ssh_config).get("hostname") or spec.host
        if ssh_config:  # read once: a Fabric Connection per host would read the config anew for each
            import paramiko

            if not parsed:
                parsed.append(paramiko.SSHConfig.from_path(os.path.expanduser(ssh_config)))
            return str(parsed[0].lookup(spec.host).get("hostname", spec.host))
        from dtf.hosts.paramikossh import ParamikoRunner

        return ParamikoRunner(spec, ssh_config).address()

    return resolve


def check_ssh_config(where: Position, ssh_config: str) -> None:
    """The inventory's ssh_config must be a file its reader can parse: say so `where` the inventory
    names it (Inventory.position, Plan.ssh_config_position), not with a traceback later. Its reader
    is OpenSSH where there is an `ssh` (`ssh -F FILE -G` reads the whole file), paramiko where
    there is none."""
    from dtf.errors import InventoryError, Problem

    path = os.path.expanduser(ssh_config)
    reason = None
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
    ssh = ssh_binary()
    if reason is None and ssh is not None:
        r = subprocess.run([ssh, "-F", path, "-G", "dtf-ssh-config-check"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            said = [s.strip() for s in r.stderr.splitlines() if s.strip() and "terminating" not in s]
            first = said[0].removeprefix(f"{path}: ") if said else f"ssh -G exit {r.returncode}"
            reason = f"cannot parse it: {first}"
    if reason is None and ssh is None:
        import paramiko

        try:
            paramiko.SSHConfig.from_path(path)
        except OSError as e:
            reason = e.strerror or str(e)
        except Exception as e:  # paramiko's own parse errors
            reason = f"cannot parse it: {e}"
    if reason is not None:
        problem = Problem(where.file, where.line, where.column, "ssh_config", f"{ssh_config}: {reason}")
        raise InventoryError([problem])
