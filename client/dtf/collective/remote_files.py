"""Directory trees between this machine and a host, over a CommandRunner: send one (a deterministic
tar, unpacked there by the host's python), or bring one back (the runner's fetch_tree: a tar
over OpenSSH or a job step, SFTP where there is no `ssh` binary, a copy for local hosts).

Collective mode brings the chief's output directory back with `fetch_tree`, and copies the
chief's backup to the other workers with `send_tree` (the program itself goes as `dtf sync` sends
it: dtf.files.sync).
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
from pathlib import Path

from dtf.cluster.plan import HostPlan
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.programs import script

EXTRACT_TIMEOUT = 120.0
_UNPACK = script("unpack.py")  # the host's python: a tar unpacked into its directory


def _files(root: Path) -> list[tuple[str, Path]]:
    """Every regular file below `root` (links to files followed), sorted; no __pycache__, no .git."""
    found = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", ".git"))
        for name in names:
            path = Path(directory, name)
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def pack(root: Path) -> bytes:
    """A deterministic tar of `root`'s files: the same files always make the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in _files(root):
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def send_tree(t: CommandRunner, hp: HostPlan, data: bytes, remote: str, once: bool = False) -> None:
    """Unpack the tar `data` into `remote` on the host (merged into it; with `once`, only if
    `remote` does not exist yet, and atomically)."""
    parent, base = posixpath.split(remote.rstrip("/"))
    name = f".{base}.tar"
    t.put_bytes(data, parent, name)
    r = t.run([hp.python, "-c", _UNPACK, posixpath.join(parent, name), remote, "once" if once else "merge"],
              timeout=EXTRACT_TIMEOUT)
    if not r.ok:
        raise HostError(f"unpacking into {remote} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


def fetch_tree(t: CommandRunner, remote: str, local: Path) -> int:
    """Copy the host's directory `remote` into `local` (merged; files replaced); the number of
    files copied (0 when `remote` does not exist)."""
    local.mkdir(parents=True, exist_ok=True)
    return t.fetch_tree(remote, local)
