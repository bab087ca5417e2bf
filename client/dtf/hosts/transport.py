"""How dtf reaches a host: one interface, two twins (SSH through Fabric, and local processes).

Both take argv lists (quoted in one place, dtf.hosts.shell), put files, and stream a command's output.
Every operation has a timeout; failures become `HostError` with a short reason a user can act on
("unreachable: ...", "authentication refused ...", "python missing ...").
Constructors do no I/O: `open()` (or `with`) connects, `close()` always runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtf.cluster.inventory import HostSpec, Position
from dtf.hosts.netutil import CONNECT_TIMEOUT, port_open
from dtf.hosts.openssh import ssh_argv, ssh_binary
from dtf.hosts.shell import expand_local, render

if TYPE_CHECKING:
    from dtf.hosts.mux import MuxProcess

COMMAND_TIMEOUT = 60.0
FEED_CHUNK = 1 << 20  # bytes per write of `feed`


class Readable(Protocol):
    """What `feed` reads its input from: a binary file, or a pack made while it is read."""

    def read(self, size: int = -1, /) -> bytes: ...


class HostError(Exception):
    """A host-level failure with a one-line reason (the CLI prints `host: reason`)."""


@dataclass(frozen=True)
class Result:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class LineStream:
    """A running command's stdout, a line at a time, each read with a deadline."""

    def __init__(self, fileno: Callable[[], Any], recv: Callable[[], bytes], close: Callable[[], None]) -> None:
        self._waitable, self._recv, self._close = fileno, recv, close
        self._buffer = b""
        self.ended = False

    def readline(self, timeout: float) -> str | None:
        """The next whole line (without its newline); None if none came within `timeout` s.
        HostError once the command's output has ended."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if self.ended:
                raise HostError("the command ended")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._waitable()], [], [], left)
            if ready:
                try:
                    data = self._recv()
                except OSError as e:
                    raise HostError(f"connection lost: {e}")
                if not data:
                    self.ended = True
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def close(self) -> None:
        self._close()

    def closing_with(self, after: Callable[[], None]) -> LineStream:
        """This stream, whose close then also runs `after`."""
        own = self._close

        def both() -> None:
            try:
                own()
            finally:
                after()

        self._close = both
        return self


class Conversation:
    """A command (a process of this machine: ssh over a master) that is given `data` on its stdin,
    then keeps its stdin open: its stdout is read a line at a time, each with a deadline, and a
    line can be sent to it later (`send`). `finish` closes its stdin and collects the rest.
    The data is written from a thread of its own, stderr drained by another: neither pipe fills."""

    def __init__(self, argv: Sequence[str], data: bytes, proc: MuxProcess | None = None) -> None:
        # `proc`: the command already running as an SSH master's session (dtf.hosts.mux), not argv.
        self.proc: subprocess.Popen[bytes] | MuxProcess = proc if proc is not None else subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        stdin, stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        assert stdin is not None and stdout is not None and stderr is not None
        self._stdin, self._stdout = stdin, stdout
        self._err: list[bytes] = []
        self._written = threading.Event()

        def write() -> None:
            with contextlib.suppress(OSError):  # (it ended early: its exit status and stderr say why)
                stdin.write(data)
                stdin.flush()
            self._written.set()

        self._threads = [threading.Thread(target=write, daemon=True, name="dtf-conversation-in"),
                         threading.Thread(target=lambda: self._err.append(stderr.read()), daemon=True,
                                          name="dtf-conversation-err")]
        for thread in self._threads:
            thread.start()
        self.lines = LineStream(stdout.fileno, lambda: os.read(stdout.fileno(), 65536), self.kill)

    def readline(self, timeout: float) -> str | None:
        """The next line of its stdout; None if none came within `timeout`, or once it has ended."""
        try:
            return self.lines.readline(timeout)
        except HostError:
            return None

    def send(self, line: str) -> None:
        """One line on its stdin, once `data` is all written (a command that has ended: nothing)."""
        self._written.wait(COMMAND_TIMEOUT)
        with contextlib.suppress(OSError, ValueError):
            self._stdin.write(line.encode() + b"\n")
            self._stdin.flush()

    def finish(self, timeout: float) -> Result:
        """Its stdin closed: what it writes until it exits (within `timeout`, else it is killed), its
        stdout's lines not read yet, and its exit status."""
        with contextlib.suppress(OSError, ValueError):
            self._stdin.close()
        rest: list[str] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and (line := self.readline(left)) is not None:
            rest.append(line)
        with contextlib.suppress(subprocess.TimeoutExpired):  # (its output ended: it is exiting)
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        self.kill()
        for thread in self._threads:
            thread.join(5)
        code = self.proc.returncode if self.proc.returncode is not None else -9
        refused = getattr(self.proc, "message", "")  # (a master that refused the session says why)
        return Result(code, "".join(f"{line}\n" for line in rest),
                      b"".join(self._err).decode(errors="replace") + (f"{refused}\n" if refused else ""))

    def kill(self) -> None:
        """End it (if it has not ended) and wait for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with contextlib.suppress(OSError):
            self._stdout.close()


class Transport:
    """A connection to one host. Use as a context manager."""

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.host

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Result:
        raise NotImplementedError

    def put_bytes(self, data: bytes, remote_dir: str, filename: str) -> None:
        """Write `data` to remote_dir/filename, creating remote_dir (which may start with ~/).
        Atomic: written under a temporary name in that directory, then renamed over the file, so
        no process ever reads half of it."""
        raise NotImplementedError

    def put_file(self, local: Path, remote_dir: str, filename: str) -> None:
        """Copy a local file to remote_dir/filename, atomically as put_bytes (large files: wheels)."""
        raise NotImplementedError

    def put_then_run(self, data: bytes, remote_dir: str, filename: str, argv: Sequence[str],
                     timeout: float = COMMAND_TIMEOUT) -> Result:
        """put_bytes, then run `argv` (a twin where each command costs much, a Slurm job step,
        does both in one)."""
        self.put_bytes(data, remote_dir, filename)
        return self.run(argv, timeout=timeout)

    def stream(self, argv: Sequence[str]) -> int:
        """Run `argv` with its output going to our stdout and stderr; return its exit code."""
        raise NotImplementedError

    def feed(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
             sent: Callable[[int], None] = lambda n: None) -> Result:
        """Run `argv` with everything `source` holds as its stdin; `sent(n)` after each chunk.
        HostError when no byte moves (or the command does not finish) for `stall` seconds."""
        raise NotImplementedError

    def lines(self, argv: Sequence[str]) -> LineStream:
        """Start `argv` and read its stdout line by line as it comes (a launcher's `top`), over
        this transport's connection: for SSH, a new channel of the open connection (no new
        handshake). Close the stream to end the command."""
        raise NotImplementedError

    def reaches(self, target: str, timeout: float) -> bool:
        """Whether a TCP connection to `target` ("addr:port") opens from this machine through this
        transport: for SSH, opened by the host (what `ssh -W` does)."""
        raise NotImplementedError

    def __enter__(self) -> Transport:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def process_lines(argv: Sequence[str]) -> LineStream:
    """A process of this machine (a session of its own) whose stdout is read as a LineStream;
    closing the stream kills it. OSError if it cannot start."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    out = proc.stdout
    assert out is not None

    def close() -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.close()

    return LineStream(out.fileno, lambda: os.read(out.fileno(), 65536), close)


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


class SSHTransport(Transport):
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
        remote pty and waits for the command to end, and once in a CI run it never did. Closing
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
        ssh = ssh_binary()
        if ssh is not None:  # OpenSSH carries the bytes in C, several times faster than paramiko
            return feed_process(ssh_argv(ssh, self.spec, self.ssh_config_path, self.connect_timeout, "-T", "--")
                                + [render(argv)], source, stall, sent)
        return self.feed_channel(argv, source, stall, sent)

    def feed_channel(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
                     sent: Callable[[int], None] = lambda n: None) -> Result:
        """`feed` over this transport's open connection (paramiko copies the bytes: for small files,
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


def feed_process(argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
                 sent: Callable[[int], None] = lambda n: None) -> Result:
    """Run a local process with everything `source` holds as its stdin (see Transport.feed)."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except FileNotFoundError as e:
        return Result(127, "", str(e))
    moved = [time.monotonic()]
    done = threading.Event()

    def watchdog() -> None:  # a write to a pipe nobody reads has no timeout of its own
        while not done.wait(0.5):
            if time.monotonic() - moved[0] > stall:
                proc.kill()
                return

    threading.Thread(target=watchdog, daemon=True, name="dtf-feed-watchdog").start()
    stdin, proc.stdin = proc.stdin, None  # ours to close: communicate() must not flush it
    assert stdin is not None
    try:
        try:
            with stdin:
                while data := source.read(FEED_CHUNK):
                    stdin.write(data)
                    moved[0] = time.monotonic()
                    sent(len(data))
        except BrokenPipeError:
            pass  # the command ended early: its exit code and stderr say why
        out, err = proc.communicate(timeout=stall)
    except subprocess.TimeoutExpired:
        raise HostError(f"command timed out after {stall:g}s: {what(argv)}")
    finally:  # also when `sent` raised (Cancelled): no process is left behind
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode < 0 and time.monotonic() - moved[0] > stall:
        raise HostError(f"no progress for {stall:g}s: {what(argv)}")
    return Result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def what(argv: Sequence[str]) -> str:
    """A command, shortly, for a message: the program and its first argument after one."""
    return f"{argv[0]} {' '.join(argv[2:3])}"


def temporary_name(filename: str) -> str:
    """Where an upload is written before its rename (`clean` removes leftovers: `.tmp-`)."""
    return f".{filename}.tmp-{os.urandom(4).hex()}"  # (uuid's import, platform's with it: 5 ms of each command)


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


def transport_for(spec: HostSpec, ssh_config: str | None = None,
                  connect_timeout: float = CONNECT_TIMEOUT) -> Transport:
    if spec.connection == "local":
        return LocalTransport(spec)
    return SSHTransport(spec, ssh_config, connect_timeout)


def resolver(ssh_config: str | None, specs: Sequence[HostSpec] = ()) -> Callable[[HostSpec], str]:
    """A function giving each host's TF address: `address` key, else ssh_config's HostName. Read
    by OpenSSH where there is an `ssh` (the one that connects: `ssh -G`, every host of `specs` at
    once, and the same settings its master reads for its jump hosts), else by paramiko: importing
    it was 0.15-0.25 s of every `up`'s start, before any host was reached."""
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
        if ssh_config:  # a Fabric Connection per host reads its config anew: 100 hosts took seconds
            import paramiko

            if not parsed:
                parsed.append(paramiko.SSHConfig.from_path(os.path.expanduser(ssh_config)))
            return str(parsed[0].lookup(spec.host).get("hostname", spec.host))
        return SSHTransport(spec, ssh_config).address()

    return resolve


def check_ssh_config(where: Position, ssh_config: str, paramiko_reads: bool = False) -> None:
    """The inventory's ssh_config must be a file its readers can parse: say so `where` the inventory
    names it (Inventory.position, Plan.ssh_config_position), not with a traceback later. Its
    readers: OpenSSH, where there is an `ssh` (every connection and the hosts' TF addresses are
    its: `ssh -F FILE -G` reads the whole file), and paramiko where there is no `ssh`, or where
    `paramiko_reads` (collective mode's followers and file copies are paramiko's): not at `up`,
    which has no other use for paramiko."""
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
    if reason is None and (paramiko_reads or ssh is None):
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
