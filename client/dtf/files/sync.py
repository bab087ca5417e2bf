"""`dtf sync`: a local file or directory, sent to every host of a cluster once per content hash.

A path is packed into one deterministic tar stream (the files in sorted order, with mode 0644 or
0755, owner 0 and mtime 0: the same files always make the same bytes), named by the sha256 of
those bytes. Each host keeps what it received below WORKDIR/.cache/sync/HASH (dtf_server.receive
extracts it atomically, and checks the hash); a host that has the hash already is skipped after
one cheap check, so a repeated sync, or the same data for another cluster on that host, sends
nothing. `dtf down` keeps the cache; `dtf down --purge` removes it.

Which files: a directory's files minus what its .gitignore files exclude (nested ones too,
matched by `pathspec` as git matches them; `.git/` itself is never sent). Only .gitignore files
inside the path count: a path the user names is sent even when a .gitignore above it ignores it
(data directories are often git-ignored precisely because they are data). A single file is sent
as it is. We read .gitignore files rather than ask `git ls-files`: data is often not in a
repository, hosts of the laptop may have no git, and one code path behaves the same everywhere.

The program finds a synced tree with `dtf.synced(NAME)`: a path relative to the servers' working
directory (WORKDIR/CLUSTER/JOB-INDEX), so one path is right on every host whatever its WORKDIR.

`pack()` is the reusable part: pack any local path to a `Pack`; `dtf.hostops.syncing.send()`
makes sure every host of a plan has it; `Synced.task_path` is where it is, seen from any task.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import queue
import re
import stat
import tarfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from dtf.errors import DtfError, ExitCode
from dtf_server.protocol import Layout

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
LARGE = 100 * 2**20  # a transfer above this many bytes gets a warning naming its largest files
PROGRESS_EVERY = 0.25  # seconds between progress updates of one host's transfer
_CHUNK = 1 << 20


class SyncError(DtfError):
    """A path cannot be packed (missing, unreadable, empty after .gitignore): one line why."""

    exit_code = ExitCode.USAGE


def name_flaw(name: str) -> str | None:
    """Why `name` cannot name a synced tree, or None."""
    if not NAME.fullmatch(name):
        return ("expected a name of at most 63 letters, digits, '_', '.' or '-', starting with a "
                f"letter or digit, got {name!r}")
    return None


def default_name(path: str) -> str:
    """A tree's name when none is given: the last part of its path."""
    return os.path.basename(os.path.normpath(os.path.expanduser(path)))


# -- which files ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileList:
    files: tuple[tuple[str, Path], ...]  # (name in the pack, posix and relative; the local file)
    skipped: tuple[str, ...]  # what could not be sent: symlinks to directories, broken links, fifos


def list_files(root: Path) -> FileList:
    """The files of `root` to send, sorted by name; a single file is itself."""
    if root.is_file():
        return FileList(((root.name, root),), ())
    if not root.is_dir():
        raise SyncError(f"{root}: no such file or directory")
    from pathspec import GitIgnoreSpec

    specs: list[tuple[str, Any]] = []  # (directory relative to root, its .gitignore), outermost first
    files: list[tuple[str, Path]] = []
    skipped: list[str] = []

    def ignored(rel: str, is_dir: bool) -> bool:
        """git's rule: the deepest .gitignore with a matching pattern decides, and in it the last."""
        for base, spec in reversed(specs):
            if base and not rel.startswith(base + "/"):
                continue
            result = spec.check_file(rel[len(base) + 1 if base else 0:] + ("/" if is_dir else ""))
            if result.include is not None:
                return bool(result.include)
        return False

    def walk(directory: Path, rel: str) -> None:
        gitignore = directory / ".gitignore"
        pushed = gitignore.is_file()
        if pushed:
            lines = gitignore.read_text(errors="replace").splitlines()
            specs.append((rel, GitIgnoreSpec.from_lines(lines)))
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            raise SyncError(f"cannot read {directory}: {e.strerror or e}")
        for entry in entries:
            name = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name != ".git" and not ignored(name, True):
                    walk(Path(entry.path), name)
            elif ignored(name, False):
                continue
            elif entry.is_file():  # a link to a file too: its content is sent
                files.append((name, Path(entry.path)))
            else:
                skipped.append(name + (" (a link to a directory: not followed)" if entry.is_dir()
                                       else " (not a regular file)"))
        if pushed:
            specs.pop()

    walk(root, "")
    if not files:
        raise SyncError(f"{root}: no file to send (empty, or every file is ignored by .gitignore)")
    return FileList(tuple(sorted(files)), tuple(skipped))


# -- the pack ---------------------------------------------------------------------------------
class _Spec(Protocol):
    @property
    def workdir(self) -> str: ...


class _Host(Protocol):
    """A host of a plan (dtf.cluster.plan.HostPlan): this layer is below the plan."""

    @property
    def spec(self) -> _Spec: ...


@dataclass(frozen=True)
class Synced:
    """A tree as the hosts hold it (and the record remembers it)."""

    name: str
    digest: str  # sha256 of the pack: the directory WORKDIR/.cache/sync/DIGEST on each host
    subpath: str  # "" for a directory; the file's name for a single file
    source: str  # the local path it was packed from (absolute)
    size: int  # bytes of its files
    files: int

    @property
    def task_path(self) -> str:
        """The tree (or the single file) as a path relative to any task's working directory."""
        return Layout.synced_from_task(self.digest, self.subpath)

    def host_path(self, hp: _Host) -> str:
        """The tree (or the single file) on that host, absolute or `~/`-relative as its workdir."""
        return posixpath.join(Layout.cache_dir(hp.spec.workdir, "sync"), self.digest, *filter(None, [self.subpath]))

    @property
    def short(self) -> str:
        return self.digest[:12]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "subpath": self.subpath, "source": self.source,
                "size": self.size, "files": self.files}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Synced:
        return cls(name=str(data["name"]), digest=str(data["digest"]), subpath=str(data["subpath"]),
                   source=str(data["source"]), size=int(data["size"]), files=int(data["files"]))


@dataclass(frozen=True)
class Pack:
    """A tree ready to send: its files, and the hash and size of their pack. The pack itself is
    never stored: `open()` makes it again while it is read (no temporary copy of the data)."""

    synced: Synced
    files: tuple[tuple[str, Path], ...]  # (name in the pack, the local file), sorted
    bytes: int  # of the pack (a little more than the files: tar headers)
    sizes: tuple[tuple[str, int], ...]  # (name, size) of every file
    skipped: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.synced.name

    @property
    def digest(self) -> str:
        return self.synced.digest

    def largest(self, n: int = 5) -> list[tuple[str, int]]:
        return sorted(self.sizes, key=lambda f: (-f[1], f[0]))[:n]

    def open(self) -> PackStream:
        """The pack's bytes, made as they are read (a file that changed since `pack()` makes
        other bytes: the host's hash check refuses them)."""
        return PackStream(self.files)


class _HashingWriter:
    def __init__(self, raw: IO[bytes] | None) -> None:
        self.raw, self.sha, self.count = raw, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.count += len(data)
        return self.raw.write(data) if self.raw is not None else len(data)


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o755 if mode & stat.S_IXUSR else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_pack(files: Sequence[tuple[str, Path]], out: IO[bytes] | None) -> tuple[str, int, list[tuple[str, int]]]:
    """Write the deterministic tar of `files` to `out` (None: only hash it): (sha256 hex, bytes,
    the files' sizes)."""
    writer = _HashingWriter(out)
    sizes = []
    # Writes of 1 MB (not 10 KB): the bytes are the same, the calls (and queue items) fewer.
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                      bufsize=_CHUNK) as tar:
        for name, path in files:
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    tar.addfile(_tarinfo(name, st.st_size, st.st_mode), f)
            except OSError as e:  # tarfile's "unexpected end of data" too: the file shrank meanwhile
                raise SyncError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
            sizes.append((name, st.st_size))
    return writer.sha.hexdigest(), writer.count, sizes


class _Stopped(Exception):
    pass


class PackStream:
    """A readable stream of a pack, written by a thread of its own through a bounded queue (at
    most QUEUED chunks ahead of the reader). `close()` (or leaving `with`) stops the writer."""

    QUEUED = 64

    def __init__(self, files: Sequence[tuple[str, Path]]) -> None:
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=self.QUEUED)
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.buffer = b""
        self.done = False
        self.thread = threading.Thread(target=self._write, args=(files,), daemon=True, name="dtf-pack")
        self.thread.start()

    def _write(self, files: Sequence[tuple[str, Path]]) -> None:
        try:
            write_pack(files, self)  # type: ignore[arg-type]  # a writer: write() is all it needs
        except _Stopped:
            return
        except BaseException as e:
            self.error = e
        self._put(None)

    def _put(self, item: bytes | None) -> None:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    def write(self, data: bytes) -> int:
        if data:
            self._put(bytes(data))
        return len(data)

    def read(self, size: int = -1) -> bytes:
        parts, have = [self.buffer], len(self.buffer)
        while not self.done and (size < 0 or have < size):
            item = self.queue.get()
            if item is None:
                self.done = True
                if self.error is not None:
                    raise self.error
                break
            parts.append(item)
            have += len(item)
        data = b"".join(parts)
        if size < 0:
            self.buffer = b""
            return data
        self.buffer = data[size:]
        return data[:size]

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def __enter__(self) -> PackStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pack(path: str | Path, name: str) -> Pack:
    """List a local file or directory and hash its pack (reading every file once, storing nothing)."""
    root = Path(os.path.expanduser(str(path))).resolve()
    if not root.exists():
        raise SyncError(f"{path}: no such file or directory")
    listed = list_files(root)
    digest, count, sizes = write_pack(listed.files, None)
    synced = Synced(name=name, digest=digest, subpath=root.name if root.is_file() else "", source=str(root),
                    size=sum(s for _, s in sizes), files=len(sizes))
    return Pack(synced, listed.files, count, tuple(sizes), listed.skipped)


@contextlib.contextmanager
def packed(items: Sequence[tuple[str, str]]) -> Iterator[list[Pack]]:
    """Pack every (name, path), for as long as the block runs."""
    yield [pack(path, name) for name, path in items]


# -- sending ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostSynced:
    """What one host got: per pack name, the bytes it received (0: it had the tree already),
    from which host it copied them ("": the laptop sent them), and how long that took."""

    sent: dict[str, int]
    via: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Meter:
    """Bytes sent to one host, reported as a progress step at most every PROGRESS_EVERY s."""

    def __init__(self, report: Callable[[str], None], name: str, total: int) -> None:
        self.report, self.name, self.total = report, name, total
        self.done, self.t0, self.last = 0, time.monotonic(), 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY or self.done >= self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-6)
            self.report(f"sending {self.name}: {megabytes(self.done)} of {megabytes(self.total)}, "
                        f"{megabytes(rate)}/s")


@dataclass(frozen=True)
class Report:
    """One pack after a sync: per host, the bytes sent (0: it had them) and how long it took."""

    synced: Synced
    sent: dict[str, int]
    seconds: dict[str, float]
    via: dict[str, str] = field(default_factory=dict)  # host -> the host it copied from ("": the laptop)

    def line(self) -> str:
        """`NAME (N files, SIZE, HASH...): sent to h0 (SIZE in SECONDS, RATE); h1 copied it from
        other hosts (the last in SECONDS); h2 had it already (skipped)`."""
        s = self.synced
        had = [h for h, n in self.sent.items() if n == 0]
        copied = [h for h, n in self.sent.items() if n and self.via.get(h)]
        parts = [f"sent to {h} ({megabytes(n)} in {self.seconds[h]:.1f}s, "
                 f"{megabytes(n / max(self.seconds[h], 1e-6))}/s)" for h, n in self.sent.items()
                 if n and not self.via.get(h)]
        if copied:
            names = ", ".join(copied) if len(copied) <= 6 else f"{', '.join(copied[:3])} and {len(copied) - 3} more"
            last = max(self.seconds[h] for h in copied)
            parts.append(f"{names} copied it from other hosts (the last in {last:.1f}s)")
        if had:
            parts.append(f"{', '.join(had)} had it already (skipped)")
        return (f"synced {s.name} ({s.files} file(s), {megabytes(s.size)}, {s.short}): {'; '.join(parts)}; "
                f"dtf.synced({s.name!r}) is {s.task_path} on the workers")


def large_warning(p: Pack, threshold: int = LARGE) -> str | None:
    """A warning naming the largest files, when the pack is above `threshold` bytes."""
    if p.bytes <= threshold:
        return None
    biggest = ", ".join(f"{name} ({megabytes(size)})" for name, size in p.largest())
    return (f"{p.name} is {megabytes(p.synced.size)} in {p.synced.files} file(s); the largest: {biggest} "
            f"(a .gitignore in {p.synced.source} can leave files out)")
