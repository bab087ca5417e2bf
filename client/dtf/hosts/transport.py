"""The local twin of the Transport interface (dtf.hosts.base): a `connection: local` host's
commands and files are processes and files of this machine. Also: which twin reaches a host
(`transport_for`), and where each host's TF address comes from (`resolver`).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtf.cluster.inventory import HostSpec, Position
from dtf.hosts.base import (
    COMMAND_TIMEOUT,
    FEED_CHUNK,
    Conversation,
    HostError,
    LineStream,
    Output,
    Readable,
    Result,
    Transport,
    feed_process,
    process_lines,
    process_output,
    read_process,
    temporary_name,
    what,
)
from dtf.hosts.netutil import CONNECT_TIMEOUT, port_open
from dtf.hosts.shell import expand_local

# The interface's names, for the modules that import them from here.
__all__ = ["COMMAND_TIMEOUT", "FEED_CHUNK", "Conversation", "HostError", "LineStream", "LocalTransport", "Output",
           "Readable", "Result", "Transport", "check_ssh_config", "feed_process", "process_lines", "resolver",
           "temporary_name", "transport_for", "what"]


class LocalTransport(Transport):
    """The tasks of a `connection: local` host run as processes of this machine."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Result:
        try:
            # A session of its own, as a command on a remote host has: a Ctrl-C at the terminal
            # goes to dtf, which decides (a rollback must not lose the `stop` it is running).
            proc = subprocess.run(expand_local(argv), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        except FileNotFoundError as e:
            return Result(127, "", str(e))
        except subprocess.TimeoutExpired:
            raise HostError(f"command timed out after {timeout:g}s: {argv[0]} {' '.join(argv[2:3])}")
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def put_bytes(self, data: bytes, remote_dir: str, filename: str) -> None:
        directory = Path(os.path.expanduser(remote_dir))
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / temporary_name(filename)
        tmp.write_bytes(data)
        os.replace(tmp, directory / filename)

    def put_file(self, local: Path, remote_dir: str, filename: str) -> None:
        import shutil

        directory = Path(os.path.expanduser(remote_dir))
        tmp = directory / temporary_name(filename)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, tmp)
            os.replace(tmp, directory / filename)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise HostError(f"copying {local.name} to {remote_dir} failed: {e.strerror or e}")

    def stream(self, argv: Sequence[str]) -> int:
        return subprocess.call(expand_local(argv), stdin=subprocess.DEVNULL)

    def lines(self, argv: Sequence[str]) -> LineStream:
        try:
            return process_lines(expand_local(argv))
        except FileNotFoundError as e:
            raise HostError(str(e))

    def feed(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
             sent: Callable[[int], None] = lambda n: None) -> Result:
        return feed_process(expand_local(argv), source, stall, sent)

    def reaches(self, target: str, timeout: float) -> bool:
        host, _, port = target.rpartition(":")
        return port_open(host, int(port), timeout)


    def output(self, argv: Sequence[str]) -> Output:
        return process_output(expand_local(argv))

    def read_output(self, argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
        return read_process(expand_local(argv), timeout)

    def fetch_tree(self, remote: str, local: Path) -> int:
        import shutil

        source = Path(os.path.expanduser(remote))
        local.mkdir(parents=True, exist_ok=True)
        if not source.is_dir():
            return 0
        shutil.copytree(source, local, dirs_exist_ok=True)
        return sum(1 for p in source.rglob("*")
                   if p.is_file() and not {"__pycache__", ".git"} & set(p.relative_to(source).parts))


def transport_for(spec: HostSpec, ssh_config: str | None = None,
                  connect_timeout: float = CONNECT_TIMEOUT) -> Transport:
    if spec.connection == "local":
        return LocalTransport(spec)
    from dtf.hosts.paramikossh import ParamikoTransport

    return ParamikoTransport(spec, ssh_config, connect_timeout)


def resolver(ssh_config: str | None, specs: Sequence[HostSpec] = ()) -> Callable[[HostSpec], str]:
    """A function giving each host's TF address: `address` key, else ssh_config's HostName. Read
    by OpenSSH where there is an `ssh` (the one that connects: `ssh -G`, every host of `specs` at
    once, and the same settings its master reads for its jump hosts), else by paramiko, whose
    import would slow every `up`'s start before any host is reached."""
    from dtf.hosts.openssh import prefetch, settings, ssh_binary

    ssh = ssh_binary()
    if ssh is not None:
        prefetch(ssh, [spec for spec in specs if spec.connection == "ssh" and not spec.address], ssh_config)
    parsed: list[Any] = []  # the inventory's ssh_config, read once for every host

    def resolve(spec: HostSpec) -> str:
        if spec.address:
            return spec.address
        if spec.connection == "local":
            return "127.0.0.1"
        if ssh is not None and spec.connection == "ssh":
            return settings(ssh, spec, ssh_config).get("hostname") or spec.host
        if ssh_config:  # read once: a Fabric Connection per host would read the config anew for each
            import paramiko

            if not parsed:
                parsed.append(paramiko.SSHConfig.from_path(os.path.expanduser(ssh_config)))
            return str(parsed[0].lookup(spec.host).get("hostname", spec.host))
        from dtf.hosts.paramikossh import ParamikoTransport

        return ParamikoTransport(spec, ssh_config).address()

    return resolve


def check_ssh_config(where: Position, ssh_config: str) -> None:
    """The inventory's ssh_config must be a file its reader can parse: say so `where` the inventory
    names it (Inventory.position, Plan.ssh_config_position), not with a traceback later. Its reader
    is OpenSSH where there is an `ssh` (`ssh -F FILE -G` reads the whole file), paramiko where
    there is none."""
    from dtf.errors import InventoryError, Problem
    from dtf.hosts.openssh import ssh_binary

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
