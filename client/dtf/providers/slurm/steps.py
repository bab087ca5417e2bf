"""The command runner of a node of a Slurm allocation: nothing reaches the node but Slurm. Every
command runs as a job step of the allocation (`srun --jobid=ID --overlap -N1 -n1 -w NODE ...`),
started through SSH on the login host; files travel on that step's stdin (no SSH to the node, no
shared home assumed); a TCP connection "from the host" is opened by the login host.

A `~/` in a path is expanded by the login host's shell: the nodes are assumed to give the user
the same home path (not the same files) as the login host, as Slurm sites do.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import (
    COMMAND_TIMEOUT,
    CommandRunner,
    HostError,
    LineStream,
    Output,
    Readable,
    Result,
    ServerStart,
    temporary_name,
)
from dtf.hosts.programs import script
from dtf.hosts.trees import fetch_by_tar
from dtf.providers.slurm.commands import script_text, step_argv

_PUT = script("put.sh")  # sh: stdin written to a file atomically (as put_bytes promises), then a command
_START_STEP = script_text("start_step.sh")  # sh: a step that stays, started detached, its first lines read
_CANCEL_STEP = script_text("cancel_step.sh")  # sh: the job's steps of a name cancelled
# The last line of a staying step's output when it ended (scripts/start_step.sh): its exit status.
_EXIT = "dtf-step-exit"


def _written_then(argv: Sequence[str], remote_dir: str, filename: str) -> list[str]:
    """sh that writes its stdin to remote_dir/filename (put.sh), then execs `argv`: one job step for
    both. A failed write exits 1 with the shell's message, before `argv` runs."""
    return ["sh", "-c", _PUT, "sh", remote_dir, filename, temporary_name(filename), *argv]


def step_result(r: Result) -> Result:
    """start_servers' Result: the step's lines, and its exit status where it said it (it ended)."""
    lines = r.stdout.splitlines()
    if lines and lines[-1].startswith(_EXIT + " "):
        code = lines.pop().split()[-1]
        return Result(int(code) if code.isdigit() else 1, "".join(line + "\n" for line in lines), r.stderr)
    return r


def _step_outcome(r: Result, name: str, lines: int, timeout: float) -> Result:
    """The Result of a staying step's command on the login host (start_step.sh's), or HostError where its
    lines did not all come within `timeout` (`timeout` exits 124)."""
    if r.exit_code == 124:
        said = len(r.stdout.splitlines())
        raise HostError(f"job step {name} said {said} of its {lines} line(s) within {timeout:g}s"
                        + (f": {r.stderr.strip().splitlines()[-1]}" if r.stderr.strip() else ""))
    return step_result(r)


def node_step(job: str, node: str, argv: Sequence[str], name: str = "dtf") -> list[str]:
    # Through a shell on the node: a program that is not there exits 127, as over SSH (srun's
    # own execve failure exits 2, which reads as python's "cannot open the launcher").
    return step_argv(job, node, ["sh", "-c", 'exec "$@"', "sh", *argv], name=name)


class SlurmStepRunner(CommandRunner):
    def __init__(self, spec: HostSpec, allocation: Allocation, login: CommandRunner) -> None:
        super().__init__(spec)
        self.allocation = allocation
        self.login = login  # the login host's runner (the cluster's connection to it)

    def step(self, argv: Sequence[str], name: str = "dtf") -> list[str]:
        return node_step(self.allocation.job, self.spec.host, argv, name=name)

    def open(self) -> None:
        self.login.open()

    def close(self) -> None:
        self.login.close()

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Result:
        return self.login.run(self.step(argv), timeout=timeout)

    def put_bytes(self, data: bytes, remote_dir: str, filename: str) -> None:
        self._write(io.BytesIO(data), remote_dir, filename)

    def put_file(self, local: Path, remote_dir: str, filename: str) -> None:
        with open(local, "rb") as f:
            self._write(f, remote_dir, filename)

    def _write(self, source: Readable, remote_dir: str, filename: str) -> None:
        r = self.feed(_written_then((), remote_dir, filename), source)
        if not r.ok:
            raise HostError(f"writing {remote_dir}/{filename} through a job step failed: "
                            f"{(r.stderr.strip().splitlines() or ['exit ' + str(r.exit_code)])[-1]}")

    def put_then_run(self, data: bytes, remote_dir: str, filename: str, argv: Sequence[str],
                     timeout: float = COMMAND_TIMEOUT) -> Result:
        """One job step for both (each step costs an srun, slow to start): the file on its
        stdin, then `argv`. A failed write exits 1 with the shell's message, before `argv` runs.
        Over the login host's open connection (a launcher is small: no new SSH handshake); the
        deadline is the upload's (COMMAND_TIMEOUT without progress) plus `timeout`, the command's."""
        step = _written_then(argv, remote_dir, filename)
        return self.login.run_with_input(self.step(step), data, timeout=COMMAND_TIMEOUT + timeout)

    keeps_step = True

    def start_servers(self, start: ServerStart) -> Result:
        """`start.argv` as a job step that stays (the launcher's `start --keep`: it lasts as long as
        the supervisors it forks, so Slurm accounts for them and ends them with the job), named
        `start.name`; `start.upload` (data, dir, filename): a file written on its stdin first, as
        put_then_run.

        ONE command on the login host: the step's srun is started detached there (it lives as
        long as the step), and the command returns once the step has written `start.lines` lines
        (its replies), or has ended (then its exit status is the Result's). stderr: the srun's, so
        far. HostError after `start.timeout` seconds without them, with how many it said (the
        launcher's own deadlines, shorter, end the step; `up`'s rollback stops what it started)."""
        argv, upload = start.argv, start.upload
        step = list(argv) if upload is None else _written_then(argv, upload[1], upload[2])
        srun = self.step(step, name=start.name)
        data = upload[0] if upload is not None else b""
        stall = COMMAND_TIMEOUT + start.timeout + 5
        started = ["sh", "-c", _START_STEP, "sh", str(start.lines), str(max(1, round(start.timeout))), *srun]
        r = self.login.run_with_input(started, data, timeout=stall, named=argv)
        return _step_outcome(r, start.name, start.lines, start.timeout)

    def stream(self, argv: Sequence[str]) -> int:
        return self.login.stream(self.step(argv))

    def lines(self, argv: Sequence[str]) -> LineStream:
        """`argv`'s stdout line by line (the launcher's `top` for `dtf top`), as a job step of a
        name of its own, started over the login host's connection. Closing the stream ends our
        srun there, but not the step (Slurm keeps a step whose srun died, its output going
        nowhere): close also cancels the step by its name, one command on the login host."""
        import uuid

        name = f"dtf-stream-{uuid.uuid4().hex[:12]}"
        job = self.allocation.job

        def cancel() -> None:
            try:
                self.login.run(["sh", "-c", _CANCEL_STEP, "sh", job, name], timeout=COMMAND_TIMEOUT)
            except HostError:
                pass  # the allocation's end (`dtf down`, the lease) ends the step anyway

        return self.login.lines(self.step(argv, name=name)).closing_with(cancel)

    def feed(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
             sent: Callable[[int], None] = lambda n: None) -> Result:
        return self.login.feed(self.step(argv), source, stall, sent)

    def reaches(self, target: str, timeout: float) -> bool:
        return self.login.reaches(target, timeout)

    def output(self, argv: Sequence[str]) -> Output:
        return self.login.output(self.step(argv))

    def read_output(self, argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
        return self.login.read_output(self.step(argv), timeout)

    def fetch_tree(self, remote: str, local: Path) -> int:
        """A tar on a job step's stdout (a node has no SFTP; dtf.hosts.trees)."""
        return fetch_by_tar(self, remote, local)

    def front(self) -> CommandRunner:
        return self.login
