"""Following one program copy of `dtf train --collective` from here: one session per task running
the launcher's `follow` (dtf_server.program), over the host's runner (CommandRunner.output: a
session of its OpenSSH master, a job step, a local process), turned into events on a queue.

Events: `Line(task, text)` for each line of the copy's output, `Joined(task)`, `Silent(task,
seconds)` when the host has said nothing (beats included) for SILENT seconds and `Heard(task)`
when it speaks again, and last exactly one of `Ended(task, code, reason)` (the copy ended; `code`
None when it was killed before its supervisor could say) or `Lost(task, reason)` (the host stopped
answering: no beat for HOST_LOST seconds, or the session broke).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.hostops.parallel import HostOps
from dtf.hosts.base import CommandRunner, HostError
from dtf_server.protocol import EXIT_EVENT, JOINED_EVENT, FollowRequest

BEAT = 2.0  # seconds between the host's beats
SILENT = 2.5 * BEAT  # seconds without a word: the host may be lost (TensorFlow often knows first)
HOST_LOST = 20.0  # seconds without a word from a host (beats included): it is lost
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
    return hp.launcher_argv(FollowRequest(dir=hp.root, task=task.name, beat=beat))


def node_runner(plan: Plan, hp: HostPlan, connect_timeout: float) -> CommandRunner:
    """How a host of the plan is reached, as every other command of dtf reaches it (HostOps): over
    the cluster's control master, a Slurm node through job steps, a local host as processes."""
    return HostOps(plan, connect_timeout=connect_timeout).runner(hp)


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
        with node_runner(plan, hp, connect_timeout) as t:
            stream = t.output(follow_argv(hp, task))
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
                            elif text == JOINED_EVENT:
                                events.put(Joined(task.name))
                            elif text.startswith(EXIT_EVENT) and ending is None:
                                said = json.loads(text[len(EXIT_EVENT):])
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
