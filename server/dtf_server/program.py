"""Collective mode (`dtf train --collective`): one copy of the user's program per worker task,
run on the hosts, supervised like the servers are.

A program copy takes its task's place: the same task directory (`log`, `pid.json`,
`supervisor.json`), so `dtf status`, `dtf logs worker:1`, `dtf down` and the lease see and stop it
as they do a server. Its supervisor runs it ONCE (a restart is the laptop's decision: every copy
of a MultiWorkerMirroredStrategy program must restart together), records how it ended in
`supervisor.json` (`state: exited`, `exit_code`), and exits. The program's working directory is
the task's output directory (`JOB-INDEX/out`, also $DTF_OUTPUT_DIR): relative paths land there,
and the chief's comes back to the laptop.

`follow` is how the laptop watches one copy over one SSH session: the program's output on stdout
as it is written (from where this run began in the log), and on stderr one line per event:
`dtf-beat` every few seconds (a silent session is a lost host), `dtf-joined` once the program's
strategy has joined the cluster (the file `joined` appears: see dtf.program.hooks.collective), and last
`dtf-exit {"code": N, "reason": "..."}` when the copy has ended and its output is all sent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, BinaryIO

from dtf_server.procs import die_with_parent, expand_home, log_line, ours, proc_start_ticks, read_json
from dtf_server.protocol import (
    BEAT_EVENT,
    EXIT_EVENT,
    EXIT_STATUS_ENV,
    JOINED_EVENT,
    OFFSET_EVENT,
    Defaults,
    DetachedLayout,
    Layout,
    TaskSpec,
    ended_before_crash,
    exit_reason,
)
from dtf_server.supervisor import Supervisor

JOINED = "joined"  # written by the program (dtf.program.hooks.collective) once its strategy has joined
EXITED = "exited"  # supervisor.json's state once the program has ended
ENDED = "ended"  # where dtf.program.runner writes the exit code the program ended with (protocol.EXIT_STATUS_ENV)
FOLLOW_POLL = 0.1
WAIT_START = 30.0  # seconds `follow` waits for the copy's supervisor to have written its state


def out_dir(root: str, job: str, index: int) -> str:
    return os.path.join(Layout.task_dir(root, job, index), Layout.OUT)


class ProgramSupervisor(Supervisor):
    """Runs one program copy once; TERM is passed on to it and it gets until the stopper's KILL
    to end (TensorFlow's PreemptionCheckpointHandler saves a last checkpoint on TERM)."""

    def __init__(self, root: str, task: TaskSpec, launcher: str) -> None:
        super().__init__(root, task, limit=0, backoff=0.0)
        self.launcher = launcher
        self.out = out_dir(root, task.job, task.index)

    def spawn(self) -> None:
        for stale in (JOINED, Layout.READY, ENDED):
            path = os.path.join(self.dir, stale)
            if os.path.exists(path):
                os.unlink(path)
        os.makedirs(self.out, exist_ok=True)
        env = dict(os.environ)
        # dtf's own package, zipped beside the launcher (the `run` gives its path in HELPERS_ENV),
        # and the launcher, which it imports: `import dtf`, `python -m dtf.program.runner`.
        helpers = env.pop(Layout.HELPERS_ENV, None)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [helpers, self.launcher, env.get("PYTHONPATH")]))
        env["DTF_OUTPUT_DIR"] = os.path.abspath(self.out)
        env["DTF_JOINED"] = os.path.abspath(os.path.join(self.dir, JOINED))
        env[EXIT_STATUS_ENV] = os.path.abspath(os.path.join(self.dir, ENDED))
        self.server = subprocess.Popen(  # same process group as this supervisor: `stop` signals both
            expand_home(self.task.argv), stdin=subprocess.DEVNULL, cwd=self.out, close_fds=True, env=env,
            preexec_fn=die_with_parent)
        self.save(state="running", server_pid=self.server.pid,
                  server_ticks=proc_start_ticks(self.server.pid), server_started=time.time())

    def run(self) -> int:
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # Where this run's output begins in the task's log (it keeps earlier runs'): `follow` starts there.
        self.save(log_offset=os.path.getsize(os.path.join(self.dir, Layout.LOG)))
        log_line(f"{self.name}: running the program on port {self.task.port}")
        self.spawn()
        server = self.server
        assert isinstance(server, subprocess.Popen)
        code = self.wait_server()
        if code is None:  # stopped (TERM was passed on), or the lease lapsed
            lapsed = not self.stopping
            try:
                # Stopped: the stopper KILLs the whole group after its grace; the lease: ours.
                code = server.wait(timeout=Defaults.SERVER_STOP_GRACE if lapsed else None)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
            if lapsed:
                self.save(state=EXITED, exit_code=code, last_exit=exit_reason(code), server_pid=None)
                self.expire()
                return 0
        reason = exit_reason(code)
        ended = ended_before_crash(code, os.path.join(self.dir, ENDED))
        if ended is not None:  # its work was done: what it ended with stands
            reason = f"exited with code {ended}, then was {reason} while Python shut down"
            code = ended
        self.save(state=EXITED, exit_code=code, last_exit=reason, server_pid=None, server_ticks=None)
        log_line(f"{self.name}: the program {reason}")
        return 0


def follow(root: str, job: str, index: int, beat: float, file: str = "", offset: int = -1, lines: int = -1) -> int:
    """Stream one program copy's output and events until it has ended (see the module's doc).
    `file` (below `root`): stream that file instead of the task's log, from byte `offset`, or from
    its last `lines` lines (else its start), said first by an OFFSET_EVENT."""
    tdir = Layout.task_dir(root, job, index)
    log_path = os.path.join(root, file) if file else os.path.join(tdir, Layout.LOG)
    deadline = time.monotonic() + WAIT_START
    sup: dict[str, Any] = {}
    while "log_offset" not in sup and time.monotonic() < deadline:
        sup = read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {}
        if file and not sup and os.path.exists(log_path) and not os.path.isdir(tdir):
            break  # a detached run whose task is gone (its lease lapsed): its output stays
        time.sleep(FOLLOW_POLL)
    if "log_offset" not in sup and not (file and os.path.exists(log_path)):
        event(EXIT_EVENT + json.dumps({"code": None, "reason": "its supervisor never started"}))
        return 0
    record = read_json(os.path.join(tdir, Layout.PID))
    joined = False
    last_beat = 0.0
    if not os.path.exists(log_path):
        open(log_path, "ab").close()
    with open(log_path, "rb") as log:
        if not file:
            start = int(sup["log_offset"])
        elif lines >= 0:
            start = tail_offset(log, lines)
        else:
            start = max(0, offset)
        log.seek(start)
        if file:
            event(f"{OFFSET_EVENT}{start}")
        while True:
            alive = ours(record)  # asked before reading: all output written before its end is read
            data = log.read(65536)
            if data:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
                continue
            if not joined and os.path.exists(os.path.join(tdir, JOINED)):
                joined = True
                event(JOINED_EVENT)
            if not alive:
                break
            now = time.monotonic()
            if now - last_beat >= beat:
                last_beat = now
                event(BEAT_EVENT)
            time.sleep(FOLLOW_POLL)
    if file:  # a detached run: what its coordinator said, else its supervisor
        code, reason, _ = ending(root)
    else:
        sup = read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {}
        if sup.get("state") == EXITED:
            code, reason = sup.get("exit_code"), str(sup.get("last_exit") or "")
        else:  # its supervisor was killed before it could say (a KILL to the group: `stop`, the OOM killer)
            code, reason = None, "stopped (its supervisor was killed)"
    event(EXIT_EVENT + json.dumps({"code": code, "reason": reason}))
    return 0


def ending(root: str) -> tuple[int | None, str, float | None]:
    """How the run ended: its exit code, in words, and when. What its coordinator wrote
    (DetachedLayout.ENDED), else its supervisor (a coordinator killed: by `dtf down --stop-run`'s
    KILL, the OOM killer)."""
    said = read_json(DetachedLayout.path(root, DetachedLayout.ENDED))
    if said:
        return said.get("exit_code"), str(said.get("reason") or ""), said.get("time")
    job, index = Layout.parse_name(Layout.CHIEF)
    path = Layout.in_task(root, job, index, Layout.SUPERVISOR)
    sup = read_json(path) or {}
    if sup.get("state") == EXITED:
        return sup.get("exit_code"), str(sup.get("last_exit") or ""), os.path.getmtime(path)
    if sup:
        return None, "stopped (its coordinator was killed)", os.path.getmtime(path)
    return None, "its coordinator never started", None


def tail_offset(f: BinaryIO, lines: int) -> int:
    """Where the last `lines` lines of the open file begin (an unfinished last line is one)."""
    end = f.seek(0, os.SEEK_END)
    if lines <= 0:
        return end
    position, found = end, 0
    while position > 0:
        step = min(65536, position)
        f.seek(position - step)
        block = f.read(step)
        for i in range(len(block) - 1, -1, -1):
            at = position - step + i
            if block[i] == 10 and at != end - 1:  # a newline that ends a line before the last
                found += 1
                if found == lines:
                    return at + 1
        position -= step
    return 0


def event(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def clear_outputs(root: str, tasks: list[TaskSpec]) -> None:
    """A fresh run: remove what earlier runs of these tasks left in their output directories."""
    for task in tasks:
        shutil.rmtree(out_dir(root, task.job, task.index), ignore_errors=True)
