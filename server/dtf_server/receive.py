"""The host side of `dtf sync`: receive a packed tree on stdin into WORKDIR/.cache/sync/HASH.

The pack is a plain (uncompressed) tar stream of regular files, made deterministically by the
client (dtf.files.sync), and HASH is the sha256 of exactly those bytes. The tree is extracted into a
temporary directory beside its final place, the bytes are hashed as they arrive, and only a
stream whose hash is HASH is renamed into place: a half-written, interrupted or corrupted
transfer is never used, and a tree at HASH is always complete.

Members are checked before anything is written: regular files and directories only, relative
names without `..` (Python 3.11.2's tarfile has no extraction filter, so this is done here).

From host to host (`dtf sync` to many hosts: the laptop's uplink carries the pack once): a host
may take the pack from another host instead of stdin (`connect`: a TCP connection to that host's
relay, opened with a token), and may pass what it receives on to a few other hosts as it arrives
(`Relay`: it listens, accepts up to N children that present the token, and writes every chunk it
reads to each of them before extracting it). The bytes are not stored twice: a pipeline, whose
every stage checks the hash of what it received. A child that cannot connect, or whose stream
breaks, fails: the laptop then sends to it directly. Every wait has a deadline.

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import posixpath
import shutil
import socket
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

from dtf_server.protocol import Defaults

CHUNK = 1 << 20
TMP_PREFIX = ".tmp-"  # a receive in progress (or one killed midway): never a tree to use
ACCEPT_WAIT = Defaults.RELAY_WAIT  # seconds a relay waits for its children to connect, then starts without the others
CONNECT_WAIT = 30.0  # seconds a child keeps trying its parent (refused: it does not listen yet)
STALL = Defaults.RELAY_STALL  # seconds a host-to-host stream may make no progress before it is given up


class ReceiveError(Exception):
    """The stream is not a valid pack of HASH (the message says why, in one line)."""


class _Hashing:
    """A read-only stream that hashes and counts what is read through it."""

    def __init__(self, raw: BinaryIO, tee: Callable[[bytes], None] | None = None) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0
        self.tee = tee

    def read(self, size: int = -1) -> bytes:
        try:
            data = self.raw.read(size)
        except OSError as e:  # a host-to-host stream: its parent stalled or went away
            raise ReceiveError(f"the stream stopped after {self.count} bytes: {e.strerror or e}")
        if self.tee is not None and data:
            self.tee(data)
        self.sha.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def _safe_name(name: str) -> str:
    path = posixpath.normpath(name)
    if (not name or name.startswith("/") or path == ".." or path.startswith("../") or "\0" in name
            or path == "."):
        raise ReceiveError(f"refusing a member named {name!r}")
    return path


def present(cache: str, digest: str) -> bool:
    return os.path.isdir(os.path.join(cache, digest))


def receive(cache: str, digest: str, stream: BinaryIO, tee: Callable[[bytes], None] | None = None) -> int:
    """Extract the pack on `stream` into CACHE/DIGEST; the number of bytes read. ReceiveError if
    its hash is not DIGEST or it holds anything but regular files and directories. `tee` gets
    every chunk read, before it is extracted (a Relay passing it on)."""
    if not digest or any(c not in "0123456789abcdef" for c in digest):
        raise ReceiveError(f"expected a hex sha256, got {digest!r}")
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{digest[:12]}-", dir=cache)
    try:
        reader = _Hashing(stream, tee)
        try:
            with tarfile.open(fileobj=reader, mode="r|", bufsize=CHUNK) as tar:  # type: ignore[call-overload]
                for member in tar:
                    _extract(tar, member, tmp)
        except tarfile.TarError as e:
            raise ReceiveError(f"not a valid pack: {e}")
        reader.drain()  # the tar's end padding counts in the hash too
        if reader.sha.hexdigest() != digest:
            raise ReceiveError(f"the data received ({reader.count} bytes) does not hash to {digest[:12]}: "
                               f"the transfer was cut short or corrupted, or files changed while being sent")
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700
        try:
            os.rename(tmp, os.path.join(cache, digest))
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another sender got there first: the same tree
        return reader.count
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, root: str) -> None:
    path = os.path.join(root, _safe_name(member.name))
    if member.isdir():
        os.makedirs(path, exist_ok=True)
        return
    if not member.isfile():
        raise ReceiveError(f"refusing {member.name!r}: not a regular file")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None
    with contextlib.closing(source), open(path, "xb") as out:
        shutil.copyfileobj(source, out, CHUNK)
    os.chmod(path, 0o755 if member.mode & 0o100 else 0o644)


# -- from host to host --------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free here just now (the kernel's choice): where this host may relay from."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def connect(source: str, token: str, wait: float = CONNECT_WAIT, stall: float = STALL) -> BinaryIO:
    """The pack from a parent's Relay at `source` (ADDR:PORT): retried while refused (the parent
    is not listening yet), for `wait` seconds; every read then waits at most `stall` seconds."""
    host, _, port = source.rpartition(":")
    deadline = time.monotonic() + wait
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ReceiveError(f"cannot connect to {source} to copy from: {e.strerror or e}")
            time.sleep(0.2)
    try:
        sock.settimeout(stall)
        sock.sendall(token.encode() + b"\n")
        return sock.makefile("rb")  # the file keeps the socket open
    except OSError as e:
        sock.close()
        raise ReceiveError(f"cannot copy from {source}: {e.strerror or e}")
    finally:
        sock.close()  # the file holds its own reference; closing it closes the connection


class Relay:
    """Pass a pack on to up to `children` hosts as it arrives: listen on `port` (bound when
    made), `accept()` those that present `token`, `write()` each chunk to every one still there
    (a child that stalls for `stall` seconds, or goes away, is dropped: it fails, and the laptop
    sends to it), `close()` at the end (EOF: a child that got everything checks its hash)."""

    def __init__(self, port: int, children: int, token: str, stall: float = STALL) -> None:
        self.children, self.token, self.stall = children, token.encode(), stall
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind(("0.0.0.0", port))
            self.listener.listen(children + 4)
        except OSError:
            self.listener.close()
            raise
        self.peers: list[socket.socket] = []
        self.passed = 0

    def accept(self, wait: float = ACCEPT_WAIT) -> None:
        """Until `children` have connected with the token, or for `wait` seconds."""
        deadline = time.monotonic() + wait
        try:
            while len(self.peers) < self.children:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.listener.settimeout(left)
                try:
                    peer, _ = self.listener.accept()
                except OSError:  # the deadline (socket.timeout), or an aborted connection
                    continue
                peer.settimeout(5.0)
                try:
                    line = peer.makefile("rb").readline(len(self.token) + 2).strip()
                except OSError:
                    line = b""
                if hmac.compare_digest(line, self.token):
                    peer.settimeout(self.stall)
                    self.peers.append(peer)
                else:
                    peer.close()  # not one of ours
        finally:
            self.listener.close()

    def write(self, data: bytes) -> None:
        for peer in list(self.peers):
            try:
                peer.sendall(data)
            except OSError:
                self.peers.remove(peer)
                peer.close()

    def close(self, complete: bool) -> None:
        """End every child's stream: after the whole pack (`complete`) they see its end; else
        they are cut off, and fail."""
        for peer in self.peers:
            with contextlib.suppress(OSError):
                if complete:
                    peer.shutdown(socket.SHUT_WR)
                    peer.settimeout(self.stall)
                    peer.recv(1)  # wait until the child has read it all and closed (or the stall)
                    self.passed += 1
            peer.close()
        self.peers = []
        self.listener.close()
