"""Directory trees between this machine and a host, over a Transport: send one (a deterministic
tar, unpacked there by the host's python), or bring one back (SFTP; a copy for local hosts).

Collective mode brings the chief's output directory back with `fetch_tree`, and copies the
chief's backup to the other workers with `send_tree` (the program itself goes as `dtf sync` sends
it: dtf.files.sync).
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import shutil
import stat
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

from dtf.cluster.plan import HostPlan
from dtf.hosts.transport import HostError, LocalTransport, SSHTransport, Transport

if TYPE_CHECKING:
    from dtf.hosts.slurmstep import SlurmStepTransport

EXTRACT_TIMEOUT = 120.0
# Run by the host's python: unpack TAR into DEST (replacing it atomically when `--once` finds it
# missing; merging into it otherwise), then remove TAR.
_UNPACK = """\
import os, shutil, sys, tarfile, uuid
tar, dest, once = sys.argv[1], sys.argv[2], sys.argv[3] == "once"
try:
    if once and os.path.isdir(dest):
        sys.exit(0)
    target = dest + ".tmp-" + uuid.uuid4().hex[:8] if once else dest
    os.makedirs(target, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(target, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(target)
    if once:
        try:
            os.rename(target, dest)
        except OSError:
            shutil.rmtree(target, ignore_errors=True)  # another dtf put it there first
finally:
    os.unlink(tar)
"""


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


def send_tree(t: Transport, hp: HostPlan, data: bytes, remote: str, once: bool = False) -> None:
    """Unpack the tar `data` into `remote` on the host (merged into it; with `once`, only if
    `remote` does not exist yet, and atomically)."""
    parent, base = posixpath.split(remote.rstrip("/"))
    name = f".{base}.tar"
    t.put_bytes(data, parent, name)
    r = t.run([hp.python, "-c", _UNPACK, posixpath.join(parent, name), remote, "once" if once else "merge"],
              timeout=EXTRACT_TIMEOUT)
    if not r.ok:
        raise HostError(f"unpacking into {remote} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


def fetch_tree(t: Transport, remote: str, local: Path) -> int:
    """Copy the host's directory `remote` into `local` (merged; files replaced); the number of
    files copied (0 when `remote` does not exist)."""
    local.mkdir(parents=True, exist_ok=True)
    if isinstance(t, LocalTransport):
        source = Path(os.path.expanduser(remote))
        if not source.is_dir():
            return 0
        shutil.copytree(source, local, dirs_exist_ok=True)
        return len(_files(source))
    from dtf.hosts.slurmstep import SlurmStepTransport

    if isinstance(t, SlurmStepTransport):
        return _fetch_by_tar(t, remote, local)
    assert isinstance(t, SSHTransport)
    import paramiko

    try:
        sftp = t.connection().sftp()
        sftp.get_channel().settimeout(60.0)
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


# A Slurm node has no SFTP: the tree comes back as a tar on a job step's stdout (exit 3: no tree).
# GNU tar also says on stderr how many bytes it wrote (--totals): a stream cut short on its way
# back is then seen even where it ends on a member's boundary, which tarfile takes for the end.
_TAR_OUT = ('cd "$1" 2>/dev/null || exit 3; '
            'if tar --version 2>/dev/null | grep -q GNU; then exec tar -cf - --totals .; fi; exec tar -cf - .')
_TOTALS = re.compile(r"^Total bytes written: (\d+)", re.MULTILINE)
FETCH_STALL = 60.0  # seconds without a byte before a fetch through a job step is given up
FETCH_TIMEOUT = 600.0  # seconds a fetch over the login host's master may take in all
# Tries of a fetch through a job step whose stream came back short. Once in CI (a loaded machine,
# a node's steps just ended), a chief's output came back cut short with exit status 0: "unexpected
# end of data" in tarfile, and `dtf train` ended with an internal error.
FETCH_TRIES = 3


class _Short(Exception):
    """A job step's tar came back incomplete."""


def _fetch_by_tar(t: SlurmStepTransport, remote: str, local: Path) -> int:
    short: _Short | None = None
    for _ in range(FETCH_TRIES):
        data, code, err = _tar_of(t, remote)
        try:
            return _untar(data, local, remote, code, err)
        except _Short as e:
            short = e
    raise HostError(f"copying {remote} back failed: its tar came back incomplete {FETCH_TRIES} times ({short})")


def _tar_of(t: SlurmStepTransport, remote: str) -> tuple[io.BytesIO, int, str]:
    """The tar a job step on the node makes of `remote`: (its bytes, exit status, stderr)."""
    import paramiko

    from dtf.hosts.control import ControlTransport
    from dtf.hosts.shell import render

    data = io.BytesIO()
    if isinstance(t.login, ControlTransport):  # a session of the login host's master: bytes on stdout
        import subprocess

        t.login.open()
        argv = t.login.command("-T") + [render(t.step(["sh", "-c", _TAR_OUT, "sh", remote]))]
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=FETCH_TIMEOUT,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            raise HostError(f"copying {remote} back failed: not done after {FETCH_TIMEOUT:g}s")
        except OSError as e:
            raise HostError(f"copying {remote} back failed: {e.strerror or e}")
        data.write(p.stdout)
        return data, p.returncode, p.stderr.decode(errors="replace").strip()
    try:
        chan = t.login.connection().transport.open_session(timeout=30)
        try:
            chan.settimeout(FETCH_STALL)
            chan.exec_command(render(t.step(["sh", "-c", _TAR_OUT, "sh", remote])))
            while chunk := chan.recv(65536):
                data.write(chunk)
            code = chan.recv_exit_status()
            err = chan.makefile_stderr("rb").read().decode(errors="replace").strip()
        finally:
            chan.close()
    except (OSError, paramiko.SSHException) as e:
        raise HostError(f"copying {remote} back failed: {e}")
    return data, code, err


def _untar(data: io.BytesIO, local: Path, remote: str, code: int, err: str) -> int:
    """The tree a job step sent (_TAR_OUT's exit `code`, its stderr `err`), into `local`; _Short
    where the stream came back incomplete."""
    if code == 3:
        return 0
    if code != 0:
        said = [line for line in err.splitlines() if not _TOTALS.match(line)]
        raise HostError(f"copying {remote} back failed: {(said or [f'exit {code}'])[-1]}")
    totals = _TOTALS.search(err)
    got = data.getbuffer().nbytes
    if totals and got != int(totals[1]):
        raise _Short(f"{got} of {totals[1]} bytes")
    data.seek(0)
    count = 0
    try:
        with tarfile.open(fileobj=data) as tar:
            members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
            count = sum(1 for m in members if m.isfile())
            if hasattr(tarfile, "data_filter"):
                tar.extractall(local, members=members, filter="data")
            else:
                tar.extractall(local, members=members)
    except (tarfile.ReadError, EOFError) as e:  # (mostly in getmembers: the next try replaces what this extracted)
        raise _Short(f"{got} bytes: {e}")
    return count
