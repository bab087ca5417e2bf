"""The interface to a host (`CommandRunner`) and what its runners share: `Result`, `HostError`, line and
chunk streams of a running command, a command fed from a file.

The runners: LocalRunner (dtf.hosts.local: processes of this machine), OpenSSHRunner
(dtf.hosts.control: OpenSSH, over the host's master), ParamikoRunner (dtf.hosts.paramikossh:
where there is no `ssh` binary) and SlurmStepRunner (dtf.providers.slurm.steps: a node's job steps,
through the login host's runner). Callers use the interface alone, never a runner's class.
All take argv lists (quoted in one place, dtf.hosts.shell). Every operation has a timeout;
failures become `HostError` with a short reason a user can act on ("unreachable: ...",
"authentication refused ...", "python missing ..."). Constructors do no I/O: `open()` (or `with`)
connects, `close()` always runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import select
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtf.cluster.inventory import HostSpec

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


@dataclass(frozen=True)
class ServerStart:
    """The launcher's start (or check-start) of a host's tasks (CommandRunner.start_servers): the
    command, a name for it (a Slurm job step's), the lines it answers, its deadline, and the file
    written first (data, dir, filename): the launcher, uploaded in the same round trip."""

    argv: list[str]
    name: str
    lines: int
    timeout: float
    upload: tuple[bytes, str, str] | None = None


class CommandRunner:
    """A connection to one host. Use as a context manager."""

    # Whether what a command starts ends with the command unless the command stays (a Slurm job
    # step): the launcher's start then keeps its step for as long as its supervisors run
    # (`start --keep`, started by `start_servers`).
    keeps_step = False

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
        """put_bytes, then run `argv` (a runner where each command costs much, a Slurm job step,
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
        this runner's connection: for SSH, a new channel of the open connection (no new
        handshake). Close the stream to end the command."""
        raise NotImplementedError

    def reaches(self, target: str, timeout: float) -> bool:
        """Whether a TCP connection to `target` ("addr:port") opens from this machine through this
        runner: for SSH, opened by the host (what `ssh -W` does)."""
        raise NotImplementedError

    def run_with_input(self, argv: Sequence[str], data: bytes, timeout: float = COMMAND_TIMEOUT,
                       named: Sequence[str] | None = None) -> Result:
        """Run `argv` with `data` on its stdin, over this runner's open connection (a round
        trip, no new handshake); `timeout` for the whole; `named`: the command its errors name,
        when argv wraps it."""
        return self.feed(argv, io.BytesIO(data), stall=timeout)

    def result(self, r: Result) -> Result:
        """A command's Result as this runner ran it; HostError where the connection under it
        was lost (a runner whose commands share one connection tells so)."""
        return r

    def output(self, argv: Sequence[str]) -> Output:
        """Start `argv`; its stdout and stderr as they come (Output.read), over this runner's
        connection. Close it to end the command."""
        raise NotImplementedError

    def read_output(self, argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
        """Run `argv`: its stdout's bytes (a tar), its exit status and its stderr. HostError when it
        does not finish within `timeout`."""
        raise NotImplementedError

    def fetch_tree(self, remote: str, local: Path) -> int:
        """Copy the host's directory `remote` into `local` (merged; files replaced); the number of
        files copied (0 when `remote` does not exist)."""
        raise NotImplementedError

    def front(self) -> CommandRunner:
        """The runner of the machine in front of this host that runs its scheduler's commands:
        a Slurm node's login host; this host itself elsewhere."""
        return self

    # Whether `converse` and `put_and_converse` work: a command whose stdin stays open while its
    # output is read (an OpenSSH master's session).
    converses = False

    def converse(self, argv: Sequence[str], data: bytes) -> Conversation:
        """argv with `data` on its stdin, kept open; its output read a line at a time (Conversation)."""
        raise NotImplementedError

    def put_and_converse(self, data: bytes, remote_dir: str, filename: str, argv: Sequence[str]) -> Conversation:
        """put_bytes and `converse` in one round trip: argv is [python, remote_dir/filename, ARGS]."""
        raise NotImplementedError

    def start_servers(self, start: ServerStart) -> Result:
        """Run the launcher's start: `start.upload` written first and the command run, in one round
        trip (put_then_run), or the command alone. The Slurm node's runner keeps its job step."""
        if start.upload is not None:
            data, remote_dir, filename = start.upload
            return self.put_then_run(data, remote_dir, filename, start.argv, timeout=start.timeout)
        return self.run(start.argv, timeout=start.timeout)

    def through_front(self) -> bool:
        """Whether the host is reached through the machine in front of it (`front`): a Slurm node,
        whose network rarely takes this machine's connections."""
        return self.front() is not self

    def master_path(self) -> str | None:
        """The control socket of the OpenSSH master this runner's commands share, which
        outlives the runner (the cluster's); None where there is none."""
        return None

    def __enter__(self) -> CommandRunner:
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


class Output(Protocol):
    """A running command's stdout ("out") and stderr ("err"), as chunks."""

    def read(self, timeout: float) -> list[tuple[str, bytes]] | None:
        """What arrived within `timeout` ([] if nothing); None once both streams have ended."""
        ...

    def close(self) -> None: ...


class ProcessOutput:
    """A process of this machine (a session of its own: Ctrl-C is dtf's) as an Output; an `ssh`
    session over a host's master is one too. OSError if it cannot start."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.chunks: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.open_pipes = 2
        for kind, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            threading.Thread(target=self._pump, args=(kind, pipe), daemon=True, name="dtf-output").start()

    def _pump(self, kind: str, pipe: Any) -> None:
        for data in iter(lambda: pipe.read1(65536), b""):
            self.chunks.put((kind, data))
        self.chunks.put((kind, b""))

    def read(self, timeout: float) -> list[tuple[str, bytes]] | None:
        out = []
        try:
            out.append(self.chunks.get(timeout=timeout))
            while True:
                out.append(self.chunks.get_nowait())
        except queue.Empty:
            pass
        self.open_pipes -= sum(1 for _, data in out if not data)
        got = [(k, d) for k, d in out if d]
        return None if not got and self.open_pipes <= 0 else got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def process_output(argv: Sequence[str]) -> ProcessOutput:
    """ProcessOutput; HostError if the process cannot start."""
    try:
        return ProcessOutput(argv)
    except OSError as e:
        raise HostError(f"cannot run {argv[0]}: {e.strerror or e}")


def read_process(argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
    """A process of this machine run to its end: its stdout's bytes, exit status and stderr."""
    try:
        p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired:
        raise HostError(f"not done after {timeout:g}s: {what(argv)}")
    except OSError as e:
        raise HostError(f"cannot run {argv[0]}: {e.strerror or e}")
    return p.stdout, p.returncode, p.stderr.decode(errors="replace").strip()


def feed_process(argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
                 sent: Callable[[int], None] = lambda n: None) -> Result:
    """Run a local process with everything `source` holds as its stdin (see CommandRunner.feed)."""
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
    return f".{filename}.tmp-{os.urandom(4).hex()}"  # (not uuid: its import would slow every command)

