"""A host's directory tree brought back as a tar on a command's stdout (`tar c` there, unpacked
here): over an OpenSSH master's session, or a Slurm node's job step (a node has no SFTP).

GNU tar also says on stderr how many bytes it wrote (--totals): a stream cut short on its way
back is then seen even where it ends on a member's boundary, which tarfile takes for the end.
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.programs import script

TAR_OUT = script("tar_out.sh")  # sh: the tar of "$1" on stdout (exit 3: no such directory)
_TOTALS = re.compile(r"^Total bytes written: (\d+)", re.MULTILINE)
FETCH_TIMEOUT = 600.0  # seconds a fetch may take in all
# Tries of a fetch whose stream came back short: on a loaded machine, or a Slurm node whose steps
# just ended, a chief's output can come back cut short with exit status 0 (tarfile's "unexpected
# end of data"), which must not end `dtf train` with an internal error.
FETCH_TRIES = 3


class Short(Exception):
    """A tar came back incomplete."""


def fetch_by_tar(t: CommandRunner, remote: str, local: Path) -> int:
    """Copy the host's directory `remote` into `local` (CommandRunner.fetch_tree) as a tar on the
    stdout of `t`'s command; tried again where it came back short."""
    local.mkdir(parents=True, exist_ok=True)
    short: Short | None = None
    for _ in range(FETCH_TRIES):
        data, code, err = tar_of(t, remote)
        try:
            return untar(data, local, remote, code, err)
        except Short as e:
            short = e
    raise HostError(f"copying {remote} back failed: its tar came back incomplete {FETCH_TRIES} times ({short})")


def tar_of(t: CommandRunner, remote: str) -> tuple[io.BytesIO, int, str]:
    """The tar the host makes of `remote`: (its bytes, exit status, stderr)."""
    try:
        out, code, err = t.read_output(["sh", "-c", TAR_OUT, "sh", remote], FETCH_TIMEOUT)
    except HostError as e:
        raise HostError(f"copying {remote} back failed: {e}")
    return io.BytesIO(out), code, err


def untar(data: io.BytesIO, local: Path, remote: str, code: int, err: str) -> int:
    """The tree a host sent (TAR_OUT's exit `code`, its stderr `err`), into `local`; Short where
    the stream came back incomplete."""
    if code == 3:
        return 0
    if code != 0:
        said = [line for line in err.splitlines() if not _TOTALS.match(line)]
        raise HostError(f"copying {remote} back failed: {(said or [f'exit {code}'])[-1]}")
    totals = _TOTALS.search(err)
    got = data.getbuffer().nbytes
    if totals and got != int(totals[1]):
        raise Short(f"{got} of {totals[1]} bytes")
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
        raise Short(f"{got} bytes: {e}")
    return count
