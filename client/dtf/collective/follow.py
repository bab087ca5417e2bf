"""Following one program copy of `dtf train --collective` from here: one SSH session per task
running the launcher's `follow` (dtf_server.program), turned into events on a queue.

Events: `Line(task, text)` for each line of the copy's output, `Joined(task)`, `Silent(task,
seconds)` when the host has said nothing (beats included) for SILENT seconds and `Heard(task)`
when it speaks again, and last exactly one of `Ended(task, code, reason)` (the copy ended; `code`
None when it was killed before its supervisor could say) or `Lost(task, reason)` (the host stopped
answering: no beat for HOST_LOST seconds, or the session broke).
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.hostops.parallel import HostOps
from dtf.hosts.shell import expand_local, render
from dtf.hosts.transport import HostError, LocalTransport, SSHTransport, Transport
from dtf_server import program as host_program

BEAT = 2.0  # seconds between the host's beats
SILENT = 2.5 * BEAT  # seconds without a word: the host may be lost (TensorFlow often knows first)
HOST_LOST = 20.0  # seconds without a word from a host (beats included): it is lost
POLL = 0.05
DRAIN = 5.0  # seconds to read a copy's last output after its exit event


@dataclass(frozen=True)
class Line:
    task: str
    text: str


@dataclass(frozen=True)
class Joined:
    task: str


@dataclass(frozen=True)
class Silent:
    task: str
    seconds: float  # since the host's last word


@dataclass(frozen=True)
class Heard:
    task: str


@dataclass(frozen=True)
class Ended:
    task: str
    code: int | None
    reason: str


@dataclass(frozen=True)
class Lost:
    task: str
    reason: str


Event = Line | Joined | Silent | Heard | Ended | Lost


def follow_argv(hp: HostPlan, task: TaskPlan, beat: float = BEAT) -> list[str]:
    return hp.launcher_argv("follow", "--dir", hp.root, "--task", task.name, "--beat", f"{beat:g}")


def node_transport(plan: Plan, hp: HostPlan, connect_timeout: float) -> Transport:
    """How a host of the plan is reached, as every other command of dtf reaches it (HostOps): over
    the cluster's control master, a Slurm node through job steps, a local host as processes."""
    return HostOps(plan, connect_timeout=connect_timeout).transport(hp)


class _Stream:
    """A command's stdout and stderr as chunks, read with a timeout: a local process (an `ssh`
    session over the host's control master is one too: no new handshake), or a paramiko channel
    where there is no master (no `ssh` binary; a Slurm login host)."""

    def __init__(self, t: Transport, argv: Sequence[str]) -> None:
        from dtf.hosts.control import ControlTransport
        from dtf.hosts.slurmstep import SlurmStepTransport

        if isinstance(t, SlurmStepTransport):  # a Slurm node: a job step, through the login host's SSH
            argv, t = t.step(argv), t.login
        self.proc: subprocess.Popen[bytes] | None = None
        self.chan: Any = None
        self.chunks: queue.Queue[tuple[str, bytes]] = queue.Queue()
        command: list[str] | None = None
        if isinstance(t, LocalTransport):
            command = expand_local(argv)
        elif isinstance(t, ControlTransport):
            command = t.command("-T") + [render(argv)]
        if command is not None:
            try:
                self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, start_new_session=True)  # Ctrl-C is dtf's
            except OSError as e:
                raise HostError(f"cannot run {command[0]}: {e.strerror or e}")
            for kind, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr)):
                threading.Thread(target=self._pump, args=(kind, pipe), daemon=True).start()
        else:
            assert isinstance(t, SSHTransport)
            self.chan = t.connection().transport.open_session(timeout=30)
            self.chan.exec_command(render(argv))
        self.open_pipes = 2

    def _pump(self, kind: str, pipe: Any) -> None:
        for data in iter(lambda: pipe.read1(65536), b""):
            self.chunks.put((kind, data))
        self.chunks.put((kind, b""))

    def read(self, timeout: float) -> list[tuple[str, bytes]] | None:
        """What arrived within `timeout` ([] if nothing); None once both streams have ended."""
        if self.proc is not None:
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
        end = time.monotonic() + timeout
        while True:
            got = []
            if self.chan.recv_ready():
                got.append(("out", self.chan.recv(65536)))
            if self.chan.recv_stderr_ready():
                got.append(("err", self.chan.recv_stderr(65536)))
            got = [(k, d) for k, d in got if d]
            if got:
                return got
            if ((self.chan.exit_status_ready() or self.chan.closed)
                    and not self.chan.recv_ready() and not self.chan.recv_stderr_ready()):
                return None
            if time.monotonic() >= end:
                return []
            time.sleep(POLL)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.chan is not None:
            self.chan.close()


def follow_task(plan: Plan, task: TaskPlan, events: queue.Queue[Event], stop: threading.Event,
                connect_timeout: float, host_lost: float = HOST_LOST) -> None:
    """Follow one copy until it ends, its host is lost, or `stop` is set; put its events."""
    hp = plan.host_of(task)
    buffers = {"out": b"", "err": b""}
    last_word = time.monotonic()
    silent = False
    ending: Ended | None = None  # the host's last word, put once the copy's output is all read
    ending_at = 0.0

    def lines(kind: str, data: bytes) -> list[str]:
        buffers[kind] += data
        *complete, buffers[kind] = buffers[kind].replace(b"\r\n", b"\n").split(b"\n")
        return [c.decode(errors="replace") for c in complete]

    try:
        with node_transport(plan, hp, connect_timeout) as t:
            stream = _Stream(t, follow_argv(hp, task))
            try:
                while not stop.is_set():
                    chunks = stream.read(0.25)
                    if chunks is None:
                        break
                    if ending is not None:
                        # The exit event came on stderr: the copy's last output may still be on its
                        # way on stdout (another pipe, which may be read later). Read to the end.
                        if time.monotonic() - ending_at > DRAIN:
                            break
                    else:
                        quiet = time.monotonic() - last_word
                        if chunks:
                            last_word = time.monotonic()
                            if silent:
                                silent = False
                                events.put(Heard(task.name))
                        elif quiet > host_lost:
                            events.put(Lost(task.name, f"no word from {hp.name} for {host_lost:g}s"))
                            return
                        elif quiet > SILENT and not silent:
                            silent = True
                            events.put(Silent(task.name, quiet))
                    for kind, data in chunks:
                        for text in lines(kind, data):
                            if kind == "out":
                                events.put(Line(task.name, text.rstrip("\r")))
                            elif text == host_program.JOINED_EVENT:
                                events.put(Joined(task.name))
                            elif text.startswith(host_program.EXIT_EVENT) and ending is None:
                                said = json.loads(text[len(host_program.EXIT_EVENT):])
                                ending = Ended(task.name, said.get("code"), str(said.get("reason")))
                                ending_at = time.monotonic()
            finally:
                stream.close()
    except HostError as e:
        if ending is None:
            events.put(Lost(task.name, str(e)))
            return
    except Exception as e:  # paramiko's session errors: the host is gone as far as we can tell
        if ending is None:
            events.put(Lost(task.name, f"{type(e).__name__}: {e}"))
            return
    if ending is not None:
        if buffers["out"]:  # a last line without its newline
            events.put(Line(task.name, buffers["out"].decode(errors="replace")))
        events.put(ending)
    elif not stop.is_set():
        events.put(Lost(task.name, f"the session to {hp.name} ended before the program did"))
