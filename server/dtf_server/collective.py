"""The launcher's collective-mode commands (dtf_server.program): `run` starts one supervised copy
of the user's program per task, `run-step` is one task of the Slurm job step that runs them all,
`supervise-program` is a copy's supervisor, `follow` streams a copy's output and events."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from dtf_server import program
from dtf_server.procs import launcher, log_line, ours, proc_start_ticks, read_json, tail, variables, write_json
from dtf_server.protocol import (
    Defaults,
    FollowRequest,
    Layout,
    RunRequest,
    RunStepRequest,
    StartReply,
    SuperviseProgramRequest,
    TaskSpec,
    TaskStarted,
    exit_reason,
)
from dtf_server.start import READY_POLL, fresh_task_dir, record_supervisor
from dtf_server.supervisor import renew


def spawn_supervisor(root: str, task: TaskSpec, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a program copy's supervisor (collective mode: `supervise-program`) detached, logging
    to the task's log, and record it in pid.json."""
    tdir = fresh_task_dir(root, task)
    with open(os.path.join(tdir, Layout.LOG), "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tdir,
            start_new_session=True,  # its own session: survives the SSH session, one group to kill
            close_fds=True,
        )
    record_supervisor(tdir, task, proc.pid)
    return proc


def cmd_run(request: RunRequest) -> StartReply:
    """Collective mode: start one supervised program copy per task (see dtf_server.program); a
    task whose server or program still runs is refused. Waits only until each copy has started."""
    env = dict(os.environ)
    env.update(variables(request.env))
    os.makedirs(request.dir, exist_ok=True)
    renew(request.dir, None)
    tasks = list(request.task)
    results: dict[str, TaskStarted] = {}
    pending: dict[str, subprocess.Popen[bytes] | _Step] = {}
    if request.spawned:  # Slurm: one job step runs every copy (`run-step`); wait for this host's
        for task in tasks:
            pending[task.name] = _Step(Layout.task_dir(request.dir, task.job, task.index), request.spawned)
        tasks = []
    if request.clear_output:
        program.clear_outputs(request.dir, tasks)
    for task in tasks:
        record = read_json(Layout.in_task(request.dir, task.job, task.index, Layout.PID))
        if ours(record):
            assert record is not None
            results[task.name] = TaskStarted(ok=False, pid=record["pid"],
                                             reason="its server or program still runs")
            continue
        argv = [sys.executable, launcher(), *SuperviseProgramRequest(dir=request.dir, task=task).args()]
        pending[task.name] = spawn_supervisor(request.dir, task, argv, env)
    wait = Defaults.RUN_STEP_WAIT if request.spawned else 10
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        for name, proc in list(pending.items()):
            job, index = Layout.parse_name(name)
            state = (read_json(Layout.in_task(request.dir, job, index, Layout.SUPERVISOR)) or {}).get("state")
            if isinstance(proc, _Step) and not proc.seen:
                state = None  # an earlier run's
            code = proc.poll()
            if code is not None and state is None:
                results[name] = TaskStarted(ok=False, pid=proc.pid, reason=f"supervisor {exit_reason(code)}",
                                            log_tail=tail(Layout.in_task(request.dir, job, index, Layout.LOG)))
                del pending[name]
            elif state is not None:
                results[name] = TaskStarted(ok=True, pid=proc.pid)
                del pending[name]
        if pending:
            time.sleep(READY_POLL)
    for name, proc in pending.items():
        never = isinstance(proc, _Step) and not proc.seen
        results[name] = TaskStarted(ok=False, pid=proc.pid, reason=f"its {'job step' if never else 'supervisor'} "
                                                                     f"did not start within {wait:g}s")
    return StartReply(tasks=results)




def _foreground_in(tdir: str) -> None:
    """Become a task's supervisor in the foreground (a Slurm job step): output to the task's log,
    working directory the task's, one process group to kill, as a detached supervisor has (`stop`
    signals it)."""
    log = os.open(os.path.join(tdir, Layout.LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(tdir)
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)


def cmd_run_step(request: RunStepRequest) -> None:
    """Slurm, collective mode: one task of the job step that runs every program copy (`srun
    --ntasks=N`), so the copies see Slurm's own step environment (SLURM_PROCID,
    SLURM_STEP_NODELIST...: SlurmClusterResolver reads it). The step's task SLURM_PROCID runs the
    copy of worker task PROCID (`--task` in worker order; block distribution over the nodes in
    Slurm's order puts it on that worker's node), supervised in the foreground as `run` would
    detached; `run --spawned TOKEN` waits for it."""
    os.environ.update(variables(request.env))
    tasks = request.task
    rank = int(os.environ.get("SLURM_PROCID", "-1"))
    if not 0 <= rank < len(tasks):
        print(f"dtf run-step: SLURM_PROCID {rank} is not one of the {len(tasks)} copies", file=sys.stderr)
        sys.exit(2)
    task = tasks[rank]
    tdir = Layout.task_dir(request.dir, task.job, task.index)
    os.makedirs(tdir, exist_ok=True)
    if request.clear_output:
        program.clear_outputs(request.dir, [task])
    if os.path.exists(os.path.join(tdir, Layout.SUPERVISOR)):  # an earlier run's
        os.unlink(os.path.join(tdir, Layout.SUPERVISOR))
    _foreground_in(tdir)
    node = os.environ.get("SLURMD_NODENAME", "")
    if request.host and node and request.host[rank] != node:
        log_line(f"{task.name}: warning: Slurm ran this copy on {node}, dtf planned it on {request.host[rank]}")
    write_json(os.path.join(tdir, Layout.PID),
               {"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()), "job": task.job,
                "index": task.index, "port": task.port, "started": time.time(), "token": request.token})
    program.ProgramSupervisor(request.dir, task, launcher()).run()


def cmd_supervise_program(request: SuperviseProgramRequest) -> None:
    program.ProgramSupervisor(request.dir, request.task, launcher()).run()


def cmd_follow(request: FollowRequest) -> None:
    job, index = Layout.parse_name(request.task)
    program.follow(request.dir, job, index, request.beat, request.file, request.offset, request.lines)


class _Step:
    """A program copy started by a Slurm job step of copies (`run-step`), known by the pid.json it
    writes with the token it was given: what `run --spawned TOKEN` waits for."""

    def __init__(self, tdir: str, token: str) -> None:
        self.tdir, self.token = tdir, token
        self.pid = 0
        self.seen = False

    def poll(self) -> int | None:
        record = read_json(os.path.join(self.tdir, Layout.PID))
        if record is None or record.get("token") != self.token:
            return None  # not started yet
        self.pid, self.seen = record["pid"], True
        return None if ours(record) else 1


