"""The host side of `dtf sync`: receive a packed tree on stdin into WORKDIR/.cache/sync/HASH.

The pack is a plain (uncompressed) tar stream of regular files, made deterministically by the
client (dtf.files.sync), and HASH is the sha256 of exactly those bytes. The tree is extracted into a
temporary directory beside its final place, the bytes are hashed as they arrive, and only a
stream whose hash is HASH is renamed into place: a half-written, interrupted or corrupted
transfer is never used, and a tree at HASH is always complete.

Members are checked before anything is written: regular files and directories only, relative
names without `..` (Python 3.11.2's tarfile has no extraction filter, so this is done here).

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import shutil
import tarfile
import tempfile
from typing import BinaryIO

CHUNK = 1 << 20
TMP_PREFIX = ".tmp-"  # a receive in progress (or one killed midway): never a tree to use


class ReceiveError(Exception):
    """The stream is not a valid pack of HASH (the message says why, in one line)."""


class _Hashing:
    """A read-only stream that hashes and counts what is read through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
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


def receive(cache: str, digest: str, stream: BinaryIO) -> int:
    """Extract the pack on `stream` into CACHE/DIGEST; the number of bytes read. ReceiveError if
    its hash is not DIGEST or it holds anything but regular files and directories."""
    if not digest or any(c not in "0123456789abcdef" for c in digest):
        raise ReceiveError(f"expected a hex sha256, got {digest!r}")
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{digest[:12]}-", dir=cache)
    try:
        reader = _Hashing(stream)
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
