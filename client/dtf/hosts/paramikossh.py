"""The paramiko runner of an SSH host (through Fabric), for where there is no `ssh` binary.

Where OpenSSH's client exists every operation goes through it (dtf.hosts.control); this one keeps
dtf working without it: a handshake per runner, commands and files as channels of paramiko's
connection. ~/.ssh/config (or the inventory's ssh_config) applies as paramiko reads it.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import (
    COMMAND_TIMEOUT,
    FEED_CHUNK,
    CommandRunner,
    HostError,
    LineStream,
    Output,
    Readable,
    Result,
    temporary_name,
)
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.hosts.shell import render


class ParamikoRunner(CommandRunner):
    """A host reached over SSH with Fabric; ~/.ssh/config (or the inventory's ssh_config) applies:
    HostName, User, Port, IdentityFile, ProxyJump, UserKnownHostsFile, StrictHostKeyChecking."""

    def __init__(self, spec: HostSpec, ssh_config: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        super().__init__(spec)
        self.ssh_config_path = ssh_config
        self.connect_timeout = connect_timeout
        self._conn: Any = None

    def connection(self) -> Any:
        """The Fabric Connection (built on first use; building it reads ssh_config, no network)."""
        if self._conn is None:
            from fabric import Config, Connection

            config = Config(runtime_ssh_path=os.path.expanduser(self.ssh_config_path)
                            if self.ssh_config_path else None)
            t = self.connect_timeout
            connect_kwargs: dict[str, Any] = {"banner_timeout": t, "auth_timeout": t, "channel_timeout": t}
            if self.spec.identity_file:
                connect_kwargs["key_filename"] = [os.path.expanduser(self.spec.identity_file)]
            self._conn = Connection(self.spec.host, user=self.spec.user, port=self.spec.port,
                                    config=config, connect_timeout=int(max(1, t)),
                                    connect_kwargs=connect_kwargs)
            hop = self._conn
            while hop is not None and not isinstance(hop, str):  # ProxyJump hops are Connections
                _apply_host_key_policy(hop)
                hop = hop.gateway
        return self._conn

    def address(self) -> str:
        """The host's real address per ssh_config (HostName), for the TF cluster spec."""
        return str(self.connection().host)

    def open(self) -> None:
        import paramiko

        from dtf.hosts.knownhosts import RevokedHostKey

        conn = self.connection()
        target = f"{conn.user}@{conn.host}:{conn.port}"
        if conn.gateway is not None:
            hop = conn.gateway if isinstance(conn.gateway, str) else conn.gateway.original_host
            target += f" (via {hop})"
        try:
            conn.open()
        except TimeoutError:
            raise HostError(f"unreachable: no answer from {target} within {self.connect_timeout:g}s")
        except paramiko.BadHostKeyException:
            raise HostError(f"host key of {target} does not match known_hosts: refusing to connect")
        except RevokedHostKey as e:
            raise HostError(str(e))
        except paramiko.AuthenticationException as e:
            keys = ", ".join(conn.connect_kwargs.get("key_filename") or []) or "agent and default keys"
            raise HostError(f"authentication refused for {target} (tried {keys}): {e}")
        except paramiko.SSHException as e:
            if "known_hosts" in str(e):
                raise HostError(f"host key of {target} is unknown: add it to known_hosts "
                                f"(ssh once to {self.spec.host}) or set StrictHostKeyChecking accept-new")
            raise HostError(f"SSH to {target} failed: {e}")
        except socket.gaierror as e:
            raise HostError(f"unreachable: cannot resolve {conn.host}: {e.strerror}")
        except OSError as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise HostError(f"unreachable: {target}: {reason}")
        sock = conn.transport.sock  # a socket, or a channel of the ProxyJump hop's connection
        if isinstance(sock, socket.socket):  # paramiko leaves Nagle on: small writes wait for ACKs
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Result:
        import paramiko
        from invoke.exceptions import CommandTimedOut

        try:
            r = self.connection().run(render(argv), hide=True, warn=True, timeout=timeout, in_stream=False)
        except CommandTimedOut:
            raise HostError(f"command timed out after {timeout:g}s: {argv[0]} {' '.join(argv[2:3])}")
        except (OSError, EOFError, paramiko.SSHException) as e:  # e.g. "SSH session not active"
            raise HostError(f"connection lost: {e}")
        return Result(r.exited, r.stdout, r.stderr)

    def put_bytes(self, data: bytes, remote_dir: str, filename: str) -> None:
        import io

        import paramiko

        conn = self.connection()
        try:
            sftp = conn.sftp()
            sftp.get_channel().settimeout(COMMAND_TIMEOUT)  # no SFTP operation may hang forever
            path = remote_dir
            if path == "~" or path.startswith("~/"):  # SFTP starts in the home directory
                path = sftp.normalize(".") + path[1:]
            _sftp_makedirs(sftp, path)
            tmp = f"{path}/{temporary_name(filename)}"
            sftp.putfo(io.BytesIO(data), tmp)
            # OpenSSH's posix-rename extension replaces the target atomically (plain SFTP rename
            # refuses an existing target).
            sftp.posix_rename(tmp, f"{path}/{filename}")
        except (OSError, paramiko.SSHException) as e:
            raise HostError(f"upload to {remote_dir} failed: {e}")

    def put_file(self, local: Path, remote_dir: str, filename: str) -> None:
        import paramiko

        try:
            sftp = self.connection().sftp()
            sftp.get_channel().settimeout(COMMAND_TIMEOUT)
            path = remote_dir
            if path == "~" or path.startswith("~/"):
                path = sftp.normalize(".") + path[1:]
            _sftp_makedirs(sftp, path)
            tmp = f"{path}/{temporary_name(filename)}"
            try:
                sftp.put(str(local), tmp, confirm=True)
                sftp.posix_rename(tmp, f"{path}/{filename}")
            except (OSError, paramiko.SSHException):
                with contextlib.suppress(OSError, paramiko.SSHException):
                    sftp.remove(tmp)  # a full disk needs the space back
                raise
        except (OSError, paramiko.SSHException) as e:
            raise HostError(f"upload of {local.name} to {remote_dir} failed: {e}")

    def stream(self, argv: Sequence[str]) -> int:
        """Run argv with its output copied here as it comes, until it ends or Ctrl-C (130).

        A paramiko channel of our own, not Fabric's run(): on Ctrl-C that one sends ETX to the
        remote pty and waits for the command to end, which may never come. Closing
        the channel ends the pty's session, so the remote command gets SIGHUP, without waiting."""
        import codecs

        import paramiko

        text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span reads
        try:
            chan = self.connection().transport.open_session(timeout=self.connect_timeout)
            chan.get_pty()
            chan.exec_command(render(argv))
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise HostError(f"connection lost: {e}")
        try:
            while True:
                ready, _, _ = select.select([chan], [], [], 1.0)
                if ready:
                    data = chan.recv(65536)
                    if not data:
                        break
                    sys.stdout.write(text.decode(data))
                    sys.stdout.flush()
                elif chan.exit_status_ready() and not chan.recv_ready():  # ended, or the channel closed
                    break
            deadline = time.monotonic() + 10  # the exit status follows the end of the output
            while not chan.exit_status_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            code = chan.recv_exit_status() if chan.exit_status_ready() else -1
            return code if code >= 0 else 255  # -1: closed without a status (the connection went)
        except KeyboardInterrupt:
            return 130
        finally:
            chan.close()

    def lines(self, argv: Sequence[str]) -> LineStream:
        import paramiko

        try:
            chan = self.connection().transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(render(argv))
        except (OSError, EOFError, AttributeError, paramiko.SSHException) as e:
            raise HostError(f"connection lost: {e}")
        # No pty: closing the channel closes the command's stdout, and its next write ends it (EPIPE).
        return LineStream(lambda: chan, lambda: chan.recv(65536), chan.close)

    def feed(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
             sent: Callable[[int], None] = lambda n: None) -> Result:
        return self.feed_channel(argv, source, stall, sent)

    def feed_channel(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
                     sent: Callable[[int], None] = lambda n: None) -> Result:
        """`feed` over this runner's open connection (paramiko copies the bytes: for small files,
        where a new OpenSSH connection's handshake costs more than the copy)."""
        # A channel of our own, not Fabric's run(): its stdin pump writes 1000 bytes at a time.
        import paramiko

        conn = self.connection()
        if not conn.is_connected:
            self.open()
        try:
            channel = conn.client.get_transport().open_session(timeout=stall)
            with channel:
                channel.settimeout(stall)  # every send and receive: no progress for `stall` fails
                channel.exec_command(render(argv))
                try:
                    while data := source.read(FEED_CHUNK):
                        channel.sendall(data)
                        sent(len(data))
                    channel.shutdown_write()
                except OSError:
                    if channel.exit_status_ready():  # the command ended early: its stderr says why
                        pass
                    else:
                        raise
                out = channel.makefile("rb").read()
                err = channel.makefile_stderr("rb").read()
                code = channel.recv_exit_status()
        except TimeoutError:
            raise HostError(f"no progress for {stall:g}s: {argv[0]} {' '.join(argv[2:3])}")
        except (OSError, EOFError, paramiko.SSHException) as e:
            raise HostError(f"connection lost: {e}")
        return Result(code, out.decode(errors="replace"), err.decode(errors="replace"))

    def run_with_input(self, argv: Sequence[str], data: bytes, timeout: float = COMMAND_TIMEOUT,
                       named: Sequence[str] | None = None) -> Result:
        return self.feed_channel(argv, io.BytesIO(data), stall=timeout)

    def output(self, argv: Sequence[str]) -> Output:
        import paramiko

        try:
            chan = self.connection().transport.open_session(timeout=self.connect_timeout)
            chan.exec_command(render(argv))
        except (OSError, EOFError, AttributeError, paramiko.SSHException) as e:
            raise HostError(f"connection lost: {e}")
        return ChannelOutput(chan)

    def read_output(self, argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
        import paramiko

        data = io.BytesIO()
        try:
            chan = self.connection().transport.open_session(timeout=self.connect_timeout)
            try:
                chan.settimeout(timeout)
                chan.exec_command(render(argv))
                while chunk := chan.recv(65536):
                    data.write(chunk)
                code = chan.recv_exit_status()
                err = chan.makefile_stderr("rb").read().decode(errors="replace").strip()
            finally:
                chan.close()
        except TimeoutError:
            raise HostError(f"no progress for {timeout:g}s")
        except (OSError, EOFError, AttributeError, paramiko.SSHException) as e:
            raise HostError(f"connection lost: {e}")
        return data.getvalue(), code, err

    def fetch_tree(self, remote: str, local: Path) -> int:
        """Over SFTP."""
        import paramiko

        local.mkdir(parents=True, exist_ok=True)
        try:
            sftp = self.connection().sftp()
            sftp.get_channel().settimeout(COMMAND_TIMEOUT)
            path = remote
            if path == "~" or path.startswith("~/"):
                path = sftp.normalize(".") + path[1:]
            try:
                sftp.stat(path)
            except FileNotFoundError:
                return 0

            def walk(directory: str, into: Path) -> int:
                into.mkdir(parents=True, exist_ok=True)
                count = 0
                for entry in sftp.listdir_attr(directory):
                    source = f"{directory}/{entry.filename}"
                    if stat.S_ISDIR(entry.st_mode or 0):
                        count += walk(source, into / entry.filename)
                    elif stat.S_ISREG(entry.st_mode or 0):
                        sftp.get(source, str(into / entry.filename))
                        count += 1
                return count

            return walk(path, local)
        except (OSError, paramiko.SSHException) as e:
            raise HostError(f"copying {remote} back failed: {e}")

    def active(self) -> bool:
        """Whether the SSH connection is open and usable."""
        ssh = self._conn.transport if self._conn is not None else None
        return bool(ssh is not None and ssh.is_active())

    def open_tcp(self, target: str, timeout: float) -> Any:
        """A paramiko channel carrying a TCP connection the host opens to `target` ("addr:port")."""
        host, _, port = target.rpartition(":")
        return self.connection().transport.open_channel(
            "direct-tcpip", (host.strip("[]"), int(port)), ("127.0.0.1", 0), timeout=timeout)

    def reaches(self, target: str, timeout: float) -> bool:
        import paramiko

        try:
            self.open_tcp(target, timeout).close()
            return True
        except (paramiko.SSHException, OSError, EOFError):
            return False



def _sftp_makedirs(sftp: Any, path: str) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for part in parts:
        current = f"{current}{part}" if current in ("", "/") else f"{current}/{part}"
        try:
            sftp.stat(current)
        except OSError:
            sftp.mkdir(current)


def _apply_host_key_policy(conn: Any) -> None:
    """Check host keys the way OpenSSH does (dtf.hosts.knownhosts): Fabric by default accepts any key.

    Known keys come from ssh_config's UserKnownHostsFile and GlobalKnownHostsFile (OpenSSH's
    defaults otherwise). An unknown host is refused unless StrictHostKeyChecking is `no` or
    `accept-new` for it, and then its key is appended to the user's file; a changed or revoked
    key is always refused.
    """
    from dtf.hosts.knownhosts import KnownHosts

    KnownHosts.from_ssh_config(conn.ssh_config).install(conn.client, conn.host, int(conn.port))



class ChannelOutput:
    """A paramiko channel's stdout and stderr as an Output (dtf.hosts.base)."""

    POLL = 0.05

    def __init__(self, chan: Any) -> None:
        self.chan = chan

    def read(self, timeout: float) -> list[tuple[str, bytes]] | None:
        end = time.monotonic() + timeout
        while True:
            got = []
            if self.chan.recv_ready():
                got.append(("out", self.chan.recv(65536)))
            if self.chan.recv_stderr_ready():
                got.append(("err", self.chan.recv_stderr(65536)))
            got = [(k, d) for k, d in got if d]
            if got:
                return got
            if ((self.chan.exit_status_ready() or self.chan.closed)
                    and not self.chan.recv_ready() and not self.chan.recv_stderr_ready()):
                return None
            if time.monotonic() >= end:
                return []
            time.sleep(self.POLL)

    def close(self) -> None:
        self.chan.close()
