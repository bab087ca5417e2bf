"""`dtf attach`: follow a detached run from here, then bring its outputs back.

The run's output (DetachedLayout.OUTPUT_LOG on its coordinator's host) only grows, so a byte
offset says how much of it this machine has printed: the cursor (dtf.detached.record), saved after
every line printed. An attach prints from the cursor (from the run's start the first time; its
last N lines with `-n`), whole lines only, and a Ctrl-C (or SIGTERM, SIGHUP) is acted on between
two lines: each line is printed once however often attach is interrupted and started again.

The host is followed with the launcher's `follow --file` (dtf_server.program): the file from an
offset, beats while the run is quiet, and its exit code once it ended. A session that breaks or
goes quiet (the laptop's network, a sleep) is opened again, for up to `wait` seconds. Once the run
ended: what the program wrote comes back into the laptop's directories it was started from
(`fetch_outputs`), the record learns where the coordinator put the tasks (moves to a spare), and
attach exits with the program's exit code.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dtf.cluster import state
from dtf.cluster.plan import HostPlan
from dtf.cluster.state import DetachedRun, Record
from dtf.detached.remote import ask_state, detached_of, ended_record, fetch_outputs, host_of
from dtf.errors import ClusterDown, DtfError, UsageError
from dtf.hostops.parallel import HostOps
from dtf.hosts.base import HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.program.figures import write_atomic
from dtf_server.protocol import (
    BEAT_EVENT,
    EXIT_EVENT,
    OFFSET_EVENT,
    DetachedLayout,
    FollowRequest,
    Layout,
)

BEAT = 2.0  # seconds between the host's beats while the run is quiet
QUIET = 20.0  # seconds without a word from the host (beats included): the session is lost
RETRY_EVERY = 5.0  # seconds between two tries to follow again
WAIT = 600.0  # seconds `dtf attach` tries to reach the run's host again (--wait)
DRAIN = 5.0  # seconds to read the last output after the exit event
EXIT_INTERRUPTED = 130  # Ctrl-C: detached from the run, which goes on

Say = Callable[[str], None]


def cursor_path(home: Path, cluster: str) -> Path:
    return home / "attach" / f"{cluster}.json"


def read_cursor(home: Path, cluster: str, run_id: str) -> int:
    """Bytes of the run's output printed here so far (0: none, or another run's cursor)."""
    try:
        data = json.loads(cursor_path(home, cluster).read_text())
        return int(data["offset"]) if data.get("run_id") == run_id else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def write_cursor(home: Path, cluster: str, run_id: str, offset: int) -> None:
    """Saved whole (a rename) after every line printed: an attach interrupted at any moment
    starts the next one after the last line it printed."""
    path = cursor_path(home, cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, {"run_id": run_id, "offset": offset})


def remove_cursor(home: Path, cluster: str) -> None:
    with contextlib.suppress(OSError):
        cursor_path(home, cluster).unlink()


@dataclass
class Ending:
    code: int | None
    reason: str


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM, SIGHUP) while following: detach, leave the run going."""


@contextlib.contextmanager
def deferred_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT, SIGTERM and SIGHUP only noted while the block runs: the follower acts on them
    between two lines, never in the middle of printing one or of saving the cursor."""
    got: list[int] = []

    def note(signum: int, frame: object) -> None:
        got.append(signum)

    old = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield lambda: bool(got)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class Printer:
    """Whole lines of the run's output to `out`, the cursor saved after each."""

    def __init__(self, cluster: str, run_id: str, offset: int, out: IO[bytes]) -> None:
        self.cluster, self.run_id, self.offset, self.out = cluster, run_id, offset, out
        self.pending = b""

    def start_at(self, offset: int) -> None:
        self.offset, self.pending = offset, b""

    def feed(self, data: bytes, interrupted: Callable[[], bool]) -> None:
        self.pending += data
        while b"\n" in self.pending:
            if interrupted():
                raise Interrupted()
            line, self.pending = self.pending.split(b"\n", 1)
            self.emit(line + b"\n")

    def emit(self, line: bytes) -> None:
        self.out.write(line)
        self.out.flush()
        self.offset += len(line)
        write_cursor(state.home(), self.cluster, self.run_id, self.offset)

    def finish(self) -> None:
        """The run ended: its last line, unfinished, with a newline of ours."""
        if self.pending:
            line, self.pending = self.pending, b""
            self.out.write(line + b"\n")
            self.out.flush()
            self.offset += len(line)
            write_cursor(state.home(), self.cluster, self.run_id, self.offset)


def follow_once(ops: HostOps, hp: HostPlan, printer: Printer, lines: int | None,
                interrupted: Callable[[], bool]) -> Ending:
    """One session following the run: its ending; HostError where the session broke or went quiet."""
    request = FollowRequest(dir=hp.root, task=Layout.CHIEF, beat=BEAT,
                            file=posixpath.join(Layout.DETACHED, DetachedLayout.OUTPUT_LOG),
                            offset=printer.offset if lines is None else -1, lines=-1 if lines is None else lines)
    ending: Ending | None = None
    ending_at = 0.0
    events = b""
    with ops.runner(hp) as t:
        stream = t.output(hp.launcher_argv(request))
        try:
            last_word = time.monotonic()
            while True:
                if interrupted():
                    raise Interrupted()
                chunks = stream.read(0.25)
                if chunks is None:
                    break
                now = time.monotonic()
                if chunks:
                    last_word = now
                elif ending is None and now - last_word > QUIET:
                    raise HostError(f"no word from {hp.name} for {QUIET:g}s")
                if ending is not None and now - ending_at > DRAIN:
                    break
                for kind, data in chunks:
                    if kind == "out":
                        printer.feed(data, interrupted)
                        continue
                    events += data
                    *complete, events = events.split(b"\n")
                    for raw in complete:
                        text = raw.decode(errors="replace").strip()
                        if text.startswith(OFFSET_EVENT):
                            printer.start_at(int(text[len(OFFSET_EVENT):]))
                        elif text.startswith(EXIT_EVENT) and ending is None:
                            said = json.loads(text[len(EXIT_EVENT):])
                            ending = Ending(said.get("code"), str(said.get("reason") or ""))
                            ending_at = time.monotonic()
                        elif text and text != BEAT_EVENT and not text.startswith("dtf-"):
                            raise HostError(text)  # the launcher's own error (no such run)
        finally:
            stream.close()
    if ending is None:
        raise HostError(f"the session to {hp.name} ended before the run did")
    return ending


def job_ended(ops: HostOps) -> str | None:
    """Why the hosts' allocation ended (a Slurm job), in one line; None where it runs, where the
    hosts are no scheduler's, or where that cannot be asked now."""
    try:
        return ops.provider.ended("dtf attach") if ops.provider.ends else None
    except (HostError, DtfError):
        return None


def follow(ops: HostOps, hp: HostPlan, d: DetachedRun, cluster: str, lines: int | None, wait: float,
           say: Say, out: IO[bytes]) -> Ending:
    """Follow the run until it ends, through broken sessions (for up to `wait` seconds each time
    the host cannot be reached); Interrupted on Ctrl-C."""
    printer = Printer(cluster, d.run_id, read_cursor(state.home(), cluster, d.run_id), out)
    lost_since: float | None = None
    with deferred_signals() as interrupted:
        while True:
            try:
                # First the run's state: its launcher there too (uploaded where the lease's end
                # removed it: the run's files outlive it), and the run still the one recorded.
                reply = ask_state(ops, hp)
                if reply.state == "none" or reply.run_id != d.run_id:
                    raise UsageError(f"cluster {cluster!r}: the detached run's files are gone from {hp.name} "
                                     f"(another dtf removed them); nothing to follow")
                ending = follow_once(ops, hp, printer, lines, interrupted)
                printer.finish()
                return ending
            except HostError as e:
                lines = None  # printed from the cursor from now on
                ended = job_ended(ops)
                if ended is not None:  # a Slurm job that ended: the run, a step of it, ended with it
                    raise ClusterDown(f"cluster {cluster!r}: {ended}: the detached run ended with it (its "
                                      f"coordinator was a step of the job), and what it wrote with the nodes' disks")
                now = time.monotonic()
                if lost_since is None:
                    lost_since = now
                    say(f"lost the run's host {hp.name} ({e}): following again once it answers, for up to "
                        f"{wait:g}s (--wait; Ctrl-C leaves the run going)")
                elif now - lost_since > wait:
                    raise ClusterDown(f"cluster {cluster!r}: the detached run's host {hp.name} did not answer for "
                                      f"{wait:g}s ({e}); the run goes on if the host does (`dtf attach` again "
                                      f"later), and ends with it if it is lost: its coordinator runs there")
                end = time.monotonic() + RETRY_EVERY
                while time.monotonic() < end:
                    if interrupted():
                        raise Interrupted()
                    time.sleep(0.1)


def attach(record: Record, *, lines: int | None = None, wait: float = WAIT,
           connect_timeout: float = CONNECT_TIMEOUT, say: Say = lambda line: None,
           out: IO[bytes] | None = None) -> int:
    """`dtf attach`: the program's exit code (EXIT_INTERRUPTED where Ctrl-C detached)."""
    d = detached_of(record)
    hp = host_of(record.plan, d)
    ops = HostOps(record.plan, connect_timeout=connect_timeout)
    stream = out if out is not None else sys.stdout.buffer
    try:
        ending = follow(ops, hp, d, record.cluster, lines, wait, say, stream)
    except Interrupted:
        say(f"detached from the run on {d.host}: it goes on (`dtf attach` follows it again)")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `dtf attach | head`: the reader is gone
        return 0
    code = ending.code
    said = ending.reason or f"exited with code {code}"
    where = d.cwd + (f" and {d.output}" if d.output else "")
    if d.fetched:  # an earlier attach brought them: files here may have changed since
        say(f"the detached run on {d.host} {said}; its outputs were fetched into {where} already")
        return 1 if code is None else code
    try:
        count, reply = fetch_outputs(ops, hp, d)
    except (HostError, DtfError) as e:
        where = posixpath.join(DetachedLayout.dir(hp.root), DetachedLayout.BACK)
        say(f"warning: the run ended, but its outputs could not be fetched ({e}): they stay on {d.host} in "
            f"{DetachedLayout.dir(hp.root)}; `dtf attach` again fetches them ({where})")
        count, reply = 0, None
    if reply is not None and reply.run_id == d.run_id:
        ended_record(record, d, reply, fetched=True)
    say(f"the detached run on {d.host} {said}; {count} file(s) of its outputs fetched into {where}")
    if code is None:
        return 1
    return code
