"""The local runner of the CommandRunner interface (dtf.hosts.base): a `connection: local` host's
commands and files are processes and files of this machine. Which runner reaches a host:
dtf.hosts.connections.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from dtf.hosts.base import (
    COMMAND_TIMEOUT,
    CommandRunner,
    HostError,
    LineStream,
    Output,
    Readable,
    Result,
    feed_process,
    process_lines,
    process_output,
    read_process,
    temporary_name,
)
from dtf.hosts.netutil import port_open
from dtf.hosts.shell import expand_local


class LocalRunner(CommandRunner):
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
