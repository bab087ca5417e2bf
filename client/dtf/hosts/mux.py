"""A command over an OpenSSH master, asked of the master itself (its control socket), not of an
`ssh -S PATH HOST COMMAND` process.

It saves an exec of ssh per host and command: every `up` runs one launcher command on each host
over its master, and an ssh process (its libraries' relocations, OpenSSL's start) would do nothing
but ask the master over its socket and wait. The switch: DTF_SSH_MUX=0 in the environment makes
dtf run `ssh -S PATH HOST COMMAND` instead (`enabled`). Why it is kept: without it, the laptop's
CPU per host of `up` and of `down` misses its goal against the SSH floor at 30 and at 100 hosts
(bench/scale.py with and without DTF_SSH_MUX=0: docs/benchmarks.md). This asks the same thing in
the same words: OpenSSH's multiplexing protocol (PROTOCOL.mux in OpenSSH's source, version 4,
which every OpenSSH since 5.6 speaks), as ssh's own mux client does it (mux.c,
mux_client_request_session): the hello, then MUX_C_NEW_SESSION with the command and no tty,
then the three descriptors the session's stdin, stdout and stderr are (SCM_RIGHTS, one at a
time), then MUX_S_SESSION_OPENED, and MUX_S_EXIT_MESSAGE with the command's exit status when it
ends, and the master's closing of the control connection once the session's output is out (the
connection is held open until then: closed early, the master drops what it has not written).
The master runs the session as it runs ssh's.

`MuxProcess` is what `Conversation` and `OpenSSHRunner.run` need of a subprocess.Popen;
`terminate` closes a master as `ssh -O check` and `ssh -O exit` do (`dtf down`, one per host).
A master that does not answer the hello as version 4 raises MuxRefused before anything ran: the
caller runs the ssh command instead. The session's end as ssh's mux client reports it: the exit
status; 255 where the master ended the session without one (the connection lost, the command
killed by a signal) or refused it.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading

MUX_MSG_HELLO = 0x00000001
MUX_C_NEW_SESSION = 0x10000002
MUX_C_ALIVE_CHECK = 0x10000004
MUX_C_TERMINATE = 0x10000005
MUX_S_OK = 0x80000001
MUX_S_PERMISSION_DENIED = 0x80000002
MUX_S_FAILURE = 0x80000003
MUX_S_EXIT_MESSAGE = 0x80000004
MUX_S_ALIVE = 0x80000005
MUX_S_SESSION_OPENED = 0x80000006
MUX_S_TTY_ALLOC_FAIL = 0x80000008
VERSION = 4
NO_ESCAPE = 0xFFFFFFFF  # (EscapeChar none)
HELLO_TIMEOUT = 10.0  # seconds the master has to answer the hello (it is this machine's ssh)
SSH_FAILED = 255  # ssh's own exit status: the connection, not the command, failed
SWITCH = "DTF_SSH_MUX"  # "0": never speak the protocol here, run ssh's own mux client


def enabled() -> bool:
    """Whether commands are asked of the master here (the module's doc); DTF_SSH_MUX=0: no."""
    return os.environ.get(SWITCH, "1").strip() != "0"


class MuxRefused(Exception):
    """The master did not take the request: nothing ran."""


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _packet(*parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I", len(body)) + body


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the master closed the connection")
        data += chunk
    return data


def _read_packet(sock: socket.socket) -> tuple[int, bytes]:
    (length,) = struct.unpack(">I", _read_exact(sock, 4))
    if not 4 <= length <= 1 << 20:
        raise EOFError(f"a packet of {length} bytes")
    body = _read_exact(sock, length)
    return struct.unpack(">I", body[:4])[0], body[4:]


def _text(body: bytes) -> str:
    """The string after a request id (a failure's reason)."""
    if len(body) < 8:
        return ""
    (length,) = struct.unpack(">I", body[4:8])
    return body[8:8 + length].decode(errors="replace")


def _hello(sock: socket.socket, path: str) -> None:
    """Connect to the master at `path` and exchange the hellos; MuxRefused where it does not
    answer as version 4."""
    try:
        sock.connect(path)
        sock.sendall(_packet(struct.pack(">II", MUX_MSG_HELLO, VERSION)))
        kind, body = _read_packet(sock)
    except (OSError, EOFError) as e:
        raise MuxRefused(f"no hello from the master: {e}") from None
    if kind != MUX_MSG_HELLO or body[:4] != struct.pack(">I", VERSION):
        raise MuxRefused(f"the master speaks another protocol ({kind:#x})")


def _request(path: str, kind: int, reply: int, gone_is_ok: bool = False) -> bytes:
    """One control request to the master at `path` on a connection of its own, as ssh's `-O`
    commands ask: the reply's body after its request id. MuxRefused where it did not answer
    `reply`; `gone_is_ok`: the master closing the connection is the answer (an exiting master
    may close it before its reply is out: ssh's mux client takes that so too, mux.c)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(HELLO_TIMEOUT)
        _hello(sock, path)
        try:
            sock.sendall(_packet(struct.pack(">II", kind, 1)))
            got, body = _read_packet(sock)
        except EOFError as e:
            if gone_is_ok:
                return b""
            raise MuxRefused(f"the master did not answer: {e}") from None
        except (OSError, struct.error) as e:
            raise MuxRefused(f"the master did not answer: {e}") from None
    if got != reply:
        raise MuxRefused(f"the master refused: {_text(body) or hex(got)}")
    return body[4:]


def terminate(path: str) -> int:
    """Ask the master at `path` to exit, as `ssh -O check` then `ssh -O exit` do (mux.c,
    mux_client_request_alive and mux_client_request_terminate), with no ssh process: its process
    id, for the caller to wait for its end. MuxRefused where it did not answer, or refused."""
    alive = _request(path, MUX_C_ALIVE_CHECK, MUX_S_ALIVE)
    if len(alive) < 4:
        raise MuxRefused("the master did not say its process id")
    (pid,) = struct.unpack(">I", alive[:4])
    _request(path, MUX_C_TERMINATE, MUX_S_OK, gone_is_ok=True)
    return int(pid)


class MuxProcess:
    """`command` run by the master at `path` (see the module's doc), with stdin, stdout and stderr
    as pipes here: the part of subprocess.Popen that Conversation uses."""

    def __init__(self, path: str, command: str) -> None:
        self.returncode: int | None = None
        self.message = ""  # why the master refused the session, if it did
        self.status: int | None = None  # the exit status the master said (before the output is all out)
        self._done = threading.Event()
        self._killed = False
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read end, write end)
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(HELLO_TIMEOUT)
            _hello(sock, path)
            try:  # (the master opens the session only once it has all three descriptors)
                sock.sendall(_packet(struct.pack(">II", MUX_C_NEW_SESSION, 1), _string(b""),
                                     struct.pack(">IIIII", 0, 0, 0, 0, NO_ESCAPE), _string(b""),
                                     _string(command.encode())))
                for fd in theirs:
                    socket.send_fds(sock, [b"\0"], [fd])
            except OSError as e:
                raise MuxRefused(f"the master did not take the request: {e}") from None
        except BaseException:
            sock.close()
            for fd in theirs + ours:
                os.close(fd)
            raise
        for fd in theirs:  # the master has its own copies now
            os.close(fd)
        self._sock = sock
        self.stdin = os.fdopen(ours[0], "wb")
        self.stdout = os.fdopen(ours[1], "rb")
        self.stderr = os.fdopen(ours[2], "rb")
        threading.Thread(target=self._follow, daemon=True, name="dtf-mux").start()

    def _follow(self) -> None:
        """The master's word on the session: opened (or refused), then its exit status, then the
        connection's end. Closed here only once the master has closed it: it closes the session
        with its control connection, and the command's last output may still be on its way to
        the pipes after the exit status (ssh's mux client waits so too: mux.c)."""
        code = SSH_FAILED
        try:
            self._sock.settimeout(None)
            while True:
                kind, body = _read_packet(self._sock)
                if kind in (MUX_S_FAILURE, MUX_S_PERMISSION_DENIED):
                    self.message = f"the SSH master refused the session: {_text(body)}"
                elif kind == MUX_S_EXIT_MESSAGE and len(body) >= 8:
                    code = self.status = struct.unpack(">I", body[4:8])[0]
                # MUX_S_SESSION_OPENED, MUX_S_TTY_ALLOC_FAIL: the session goes on
        except (OSError, EOFError, struct.error):
            pass
        finally:
            self.returncode = -9 if self._killed and code == SSH_FAILED else code
            self._sock.close()
            self._done.set()

    def poll(self) -> int | None:
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("ssh mux session", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """End the session: its control connection closed, the master closes the channel (as
        when ssh's mux client is killed)."""
        if not self._done.is_set():
            self._killed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
