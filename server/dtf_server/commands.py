"""The launcher's commands. Each prints one reply (dtf_server.protocol) as JSON and exits 0 when
it did what was asked:

    check     --dir D --port P ... [--env E --wheels W]  versions, busy ports, the SSH client's
                                                   address, the platform; is managed environment E complete
    env       --env E --wheels W --uv U --requirements F  build managed environment E (dtf_server.envs)
    purge     --workdir W                          remove W/.cache (environments, wheels, synced trees)
    serve-wheels --dir W --port P --file NAME ... [--idle S]   serve those wheels to the other hosts
    fetch-wheels --from URL --dir W --file NAME:SHA256 ...    copy wheels from another host's serve-wheels
    start     --dir D --task SPEC ... [options]    start supervised servers detached, wait until each serves
                                                   (a supervisor forked per task: restarts its server when it dies);
                                                   --keep (a Slurm job step): then stay until they have ended
    serve     --job J --index I --port P --ready F [--full] (internal) run one tf.distribute.Server
    fake      --job J --index I --port P --ready F (tests) a server without TensorFlow: dtf_server.fake
    status    --dir D --task JOB:INDEX ... [--renew]  is each task alive, serving, restarted how often
    renew     --dir D [--ttl S]                    renew the cluster's lease on this host
    stop      --dir D --task JOB:INDEX ... [--grace S]  TERM the task's process group, KILL after a grace
    clean     --dir D [--keep-logs] [--if-unused]  remove what dtf put in D (firewall rules too)
    reach     [--dir D] --to ADDR:PORT ... [--timeout S]  which targets this host cannot connect to; renews D's lease
    fence     --dir D --port P ... --allow A ... [--allow-launch-node] [--remove]  TF ports open only to
                                                   A and loopback (and a Slurm step's srun host)
    sync      --dir C --hash H [--receive]         whether C/H exists; --receive: make it from the pack on stdin
              [--from ADDR:PORT] [--serve P --children N] [--token T] [--wait S] [--free-port]: host to host
    run       --dir D --task SPEC ... [--env K=V] [--clear-output]  collective mode: start program copies
    supervise-program --dir D --task SPEC          (internal) run one program copy once (dtf_server.program)
    follow    --dir D --task JOB:INDEX [--beat S]  stream a program copy's output and events until it ends
    top       --dir D --task JOB:INDEX ... [--interval S] [--for S]  one TopSample line per interval
                                                   (status, CPU%, memory, network per task) until
                                                   its reader goes, or for S seconds (`dtf top`)

SPEC is a protocol.TaskSpec as JSON: the task and the exact command its supervisor runs (the plan's).
"""

from __future__ import annotations

import os
import sys
import time

# Each command is a python start of its own (on the lab, `status` on every host is one): the
# modules only some commands use are imported by those commands, not by all of them.
from dtf_server import layout
from dtf_server.options import Namespace, Parser
from dtf_server.procs import (
    die_with_parent,
    exit_reason,
    leave,
    log_line,
    lookup_host,
    name_process,
    nvidia_gpus,
    ours,
    platform_info,
    port_busy,
    port_open,
    proc_start_ticks,
    read_json,
    server_record,
    settle_child,
    tail,
    tf_version,
    write_json,
)
from dtf_server.protocol import (
    EXIT_START_FAILED,
    EXIT_USAGE,
    CheckReply,
    CleanReply,
    Defaults,
    EnvReply,
    FenceReply,
    FetchReply,
    PurgeReply,
    ReachReply,
    RenewReply,
    Reply,
    ServeReply,
    StartReply,
    StatusReply,
    StopReply,
    SyncReply,
    TaskSample,
    TaskSpec,
    TaskStarted,
    TaskStatus,
    TaskStopped,
    TopSample,
    encode,
)
from dtf_server.supervisor import ForkedProcess, Supervisor, read_lease, renew, running_tasks, write_lease

TYPE_CHECKING = False  # (typing's, without its import: see dtf_server.protocol)
if TYPE_CHECKING:
    import _socket
    import signal
    import subprocess
    from collections.abc import Callable
    from typing import Any
else:  # signal's functions and numbers, without its enums (`import signal` imports enum: see jsontext)
    import _signal as signal

READY_POLL = 0.05
# A start looks at its servers READY_FIRST_POLL apart for its first READY_FIRST seconds: a server
# that starts at once (a fake one, a TF server whose import is cached) is seen serving 20 ms
# sooner on average; one that takes longer is looked at READY_POLL apart.
READY_FIRST_POLL, READY_FIRST = 0.01, 1.0
# Connection attempts per second a host's mesh check makes at most while other hosts' tasks refuse
# (`reach(again=True)`): each target is tried every len(targets) / REACH_RATE seconds, at least
# every REACH_PAUSE. At 30 hosts, 29 targets each tried every 50 ms made 580 refused connects a
# second per host while the others started: most of `up`'s CPU on the lab's shared cores. A few
# targets are tried as often as a start looks at its own servers: a Slurm node's two targets
# were tried 50 ms apart, and the other node's server, serving 20 ms after a refusal, was seen 30
# ms late (the whole `up` waits for the last node's check).
REACH_RATE = 100.0
REACH_PAUSE = READY_FIRST_POLL
REACH_AT_ONCE = 256  # connections a mesh check has open at once


def launcher() -> str:
    """This launcher's file (the zipapp python was asked to run)."""
    return os.path.abspath(sys.argv[0])


def parse_name(text: str) -> tuple[str, int]:
    job, index = text.split(":")
    return job, int(index)


def cmd_check(args: Namespace) -> CheckReply:
    client = os.environ.get("SSH_CONNECTION", "").split()
    machine, system, libc = platform_info()
    env_ready, wheels, free = None, [], -1
    if args.env:  # a managed environment's (dtf_server.envs: imported only where one is asked about)
        from dtf_server import envs

        env_ready = envs.ready(args.env)
        if not env_ready:  # what a build would need: only looked at when the environment is not complete
            wheels, free = envs.wheels_in(args.wheels), envs.free_space(args.wheels)
    return CheckReply(python=sys.version.split()[0], executable=sys.executable, tensorflow=tf_version(),
                      busy=[p for p in args.port if port_busy(p)],
                      client_address=client[0] if client else None,
                      running=running_tasks(args.dir) if args.dir else [],
                      machine=machine, system=system, libc=libc, env_ready=env_ready, gpus=nvidia_gpus(),
                      wheels=wheels, free=free)


def check_passes(check: CheckReply, tensorflow: str, fresh: bool, gpus: int = 0) -> bool:
    """Whether `up` goes on to start the host's servers after this check (the client decides the
    same from the CheckReply, and says why not). `gpus`: how many GPUs the host's tasks are given
    (its highest id + 1): a host whose NVIDIA driver lists fewer fails (one without a driver passes)."""
    return (check.tensorflow is not None and (not tensorflow or check.tensorflow == tensorflow)
            and not check.busy and not (fresh and check.running)
            and not (gpus and check.gpus is not None and check.gpus < gpus))


def cmd_check_start(args: Namespace) -> StartReply | None:
    """`up`'s check and start in one launcher call (one python start, one round trip): print the
    CheckReply; if the host passes it (its TensorFlow is `--tensorflow`, the ports are free, with
    `--fresh` no task of this cluster runs there, and it has the `--gpus` it is given), start the
    servers and answer their StartReply (the last line, as every command's reply)."""
    check = cmd_check(Namespace(dir=args.dir, port=args.port, env=None, wheels=None))
    print(encode(check), flush=True)
    if not check_passes(check, args.tensorflow, args.fresh, args.gpus):
        return None
    return cmd_start(args)


def cmd_env(args: Namespace) -> EnvReply:
    from dtf_server import envs
    return envs.build(args.env, args.wheels, args.uv, args.requirements)


def cmd_serve_wheels(args: Namespace) -> ServeReply:
    from dtf_server import envs
    return envs.serve(args.dir, args.port, args.file, args.idle, args.limit)


def cmd_fetch_wheels(args: Namespace) -> FetchReply:
    from dtf_server import envs
    files = [tuple(f.rsplit(":", 1)) for f in args.file]
    return envs.fetch(args.source, args.dir, [(n, h) for n, h in files], args.wait, args.timeout)


def cmd_purge(args: Namespace) -> PurgeReply:
    from dtf_server import envs
    workdir = args.workdir
    clusters = [n for n in os.listdir(workdir) if not n.startswith(".")] if os.path.isdir(workdir) else []
    running = {n: running_tasks(os.path.join(workdir, n)) for n in clusters
               if os.path.isdir(os.path.join(workdir, n))}
    return envs.purge(workdir, running)


def _fresh_task_dir(root: str, task: TaskSpec) -> str:
    """The task's directory, without what an earlier run of it left that a start waits on."""
    tdir = layout.task_dir(root, task.job, task.index)
    os.makedirs(tdir, exist_ok=True)
    for stale in (layout.READY, layout.SUPERVISOR):  # left by an earlier run
        if os.path.exists(os.path.join(tdir, stale)):
            os.unlink(os.path.join(tdir, stale))
    return tdir


def _record_supervisor(tdir: str, task: TaskSpec, pid: int) -> None:
    """The task's pid.json: its supervisor, as `ours` knows it again."""
    write_json(os.path.join(tdir, layout.PID),
               {"pid": pid, "start_ticks": proc_start_ticks(pid), "job": task.job,
                "index": task.index, "port": task.port, "started": time.time()})


def _which(command: str) -> str | None:
    """The file the PATH gives for `command`, as exec finds it (shutil's `which`: its import, of
    bz2 and lzma, is a cost of every launcher's start)."""
    if "/" in command:
        return os.path.abspath(command)
    for folder in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder or ".", command)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
    return None


# The server commands a supervisor can run in a fork of itself (Supervisor's `in_process`).
SERVER_COMMANDS = ("serve", "fake")


def in_process(argv: list[str]) -> tuple[Callable[[], int], str] | None:
    """Where a server's command is this launcher's own `serve` or `fake` on this very python
    (`PYTHON LAUNCHER serve ...`, the plan's), its code and the command's name, for its supervisor
    to run in a fork of itself (supervisor.fork_server); None for any other command: another
    python (a managed environment's: another interpreter, other packages), and a command with
    variables before it (`env CUDA_VISIBLE_DEVICES=0 ...`: `gpus`), whose server starts as its own
    process, its variables in its /proc/PID/environ for whoever checks which GPU it sees (a
    variable set in a fork is not there), its interpreter start nothing beside CUDA's."""
    if (len(argv) < 3 or argv[2] not in SERVER_COMMANDS or _which(argv[0]) != sys.executable
            or os.path.abspath(argv[1]) != launcher()
            or sys.flags.isolated or sys.flags.ignore_environment or getattr(sys.flags, "safe_path", False)):
        return None
    command = argv[2:]

    def run() -> int:
        # The site's packages (TensorFlow) on sys.path, as the server's own `python LAUNCHER serve`
        # has them: `start` runs `python -S` (bare_launcher_argv), without them.
        if sys.flags.no_site:
            import site

            site.main()
        return main(command)

    return run, command[0]


def fork_supervisor(root: str, task: TaskSpec, limit: int, backoff: float, env: dict[str, str],
                    bound: bool = False) -> ForkedProcess:
    """Start a task's supervisor detached (its own session: it survives the SSH session, and one
    process group holds it and its server), logging to the task's log, and record it in pid.json.

    Forked from this launcher, not a python of its own: it has every module it needs already, so
    it costs no interpreter start (a `python -S launcher supervise` was 40-60 ms of CPU per task
    before it spawned its server: a third of a host's `up` on the lab's shared cores). Its command
    line stays this `start`'s; its name (`ps -e`, top) says what it is: `dtf ps:0`.

    `bound` (`start --keep`, a Slurm job step): it ends with this launcher, however that ends (TERM
    when it dies: it stops its server and goes). Slurm ends a step by its process group where the
    site tracks processes by group (proctrack/pgid), and a supervisor has a session of its own."""
    tdir = _fresh_task_dir(root, task)
    parent = os.getpid()
    log = os.open(os.path.join(tdir, layout.LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the supervisor: never returns into the launcher's code
        code = 70
        try:
            os.setsid()
            if bound:
                die_with_parent(signal.SIGTERM)
                if os.getppid() != parent:  # it died before that took
                    leave(0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            settle_child(tdir, f"dtf {task.name}")
            os.environ.clear()
            os.environ.update(env)
            code = Supervisor(root, task, limit, backoff, in_process=in_process).run()
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            leave(code)
    os.close(log)
    _record_supervisor(tdir, task, pid)
    return ForkedProcess(pid)


def spawn_supervisor(root: str, task: TaskSpec, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start a program copy's supervisor (collective mode: `supervise-program`) detached, logging
    to the task's log, and record it in pid.json."""
    import subprocess  # (here only: see Supervisor.spawn)

    tdir = _fresh_task_dir(root, task)
    with open(os.path.join(tdir, layout.LOG), "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tdir,
            start_new_session=True,  # its own session: survives the SSH session, one group to kill
            close_fds=True,
        )
    _record_supervisor(tdir, task, proc.pid)
    return proc


def cmd_run(args: Namespace) -> StartReply:
    """Collective mode: start one supervised program copy per task (see dtf_server.program); a
    task whose server or program still runs is refused. Waits only until each copy has started."""
    from dtf_server import program
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    os.makedirs(args.dir, exist_ok=True)
    renew(args.dir, None)
    tasks = [TaskSpec.from_arg(a) for a in args.task]
    results: dict[str, TaskStarted] = {}
    pending: dict[str, subprocess.Popen[bytes] | _Step] = {}
    if args.spawned:  # Slurm: one job step runs every copy (`run-step`); wait for this host's
        for task in tasks:
            pending[task.name] = _Step(layout.task_dir(args.dir, task.job, task.index), args.spawned)
        tasks = []
    if args.clear_output:
        program.clear_outputs(args.dir, tasks)
    for task in tasks:
        record = read_json(layout.in_task(args.dir, task.job, task.index, layout.PID))
        if ours(record):
            assert record is not None
            results[task.name] = TaskStarted(ok=False, pid=record["pid"],
                                             reason="its server or program still runs")
            continue
        argv = [sys.executable, launcher(), "supervise-program", "--dir", args.dir, "--task", task.to_arg()]
        pending[task.name] = spawn_supervisor(args.dir, task, argv, env)
    wait = RUN_STEP_WAIT if args.spawned else 10
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        for name, proc in list(pending.items()):
            job, index = parse_name(name)
            state = (read_json(layout.in_task(args.dir, job, index, layout.SUPERVISOR)) or {}).get("state")
            if isinstance(proc, _Step) and not proc.seen:
                state = None  # an earlier run's
            code = proc.poll()
            if code is not None and state is None:
                results[name] = TaskStarted(ok=False, pid=proc.pid, reason=f"supervisor {exit_reason(code)}",
                                            log_tail=tail(layout.in_task(args.dir, job, index, layout.LOG)))
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


RUN_STEP_WAIT = 60.0  # seconds a Slurm job step of program copies gets to start them (srun, imports)


def _foreground_in(tdir: str) -> None:
    """Become a task's supervisor in the foreground (a Slurm job step): output to the task's log,
    working directory the task's, one process group to kill, as a detached supervisor has (`stop`
    signals it)."""
    log = os.open(os.path.join(tdir, layout.LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(tdir)
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)


def cmd_run_step(args: Namespace) -> None:
    """Slurm, collective mode: one task of the job step that runs every program copy (`srun
    --ntasks=N`), so the copies see Slurm's own step environment (SLURM_PROCID,
    SLURM_STEP_NODELIST...: SlurmClusterResolver reads it). The step's task SLURM_PROCID runs the
    copy of worker task PROCID (`--task` in worker order; block distribution over the nodes in
    Slurm's order puts it on that worker's node), supervised in the foreground as `run` would
    detached; `run --spawned TOKEN` waits for it."""
    from dtf_server import program
    os.environ.update(kv.split("=", 1) for kv in args.env)
    tasks = [TaskSpec.from_arg(a) for a in args.task]
    rank = int(os.environ.get("SLURM_PROCID", "-1"))
    if not 0 <= rank < len(tasks):
        print(f"dtf run-step: SLURM_PROCID {rank} is not one of the {len(tasks)} copies", file=sys.stderr)
        sys.exit(2)
    task = tasks[rank]
    tdir = layout.task_dir(args.dir, task.job, task.index)
    os.makedirs(tdir, exist_ok=True)
    if args.clear_output:
        program.clear_outputs(args.dir, [task])
    if os.path.exists(os.path.join(tdir, layout.SUPERVISOR)):  # an earlier run's
        os.unlink(os.path.join(tdir, layout.SUPERVISOR))
    _foreground_in(tdir)
    node = os.environ.get("SLURMD_NODENAME", "")
    if args.host and node and args.host[rank] != node:
        log_line(f"{task.name}: warning: Slurm ran this copy on {node}, dtf planned it on {args.host[rank]}")
    write_json(os.path.join(tdir, layout.PID),
               {"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid()), "job": task.job,
                "index": task.index, "port": task.port, "started": time.time(), "token": args.token})
    program.ProgramSupervisor(args.dir, task, launcher()).run()


def cmd_supervise_program(args: Namespace) -> None:
    from dtf_server import program
    program.ProgramSupervisor(args.dir, TaskSpec.from_arg(args.task), launcher()).run()


def cmd_follow(args: Namespace) -> None:
    from dtf_server import program
    job, index = parse_name(args.task)
    program.follow(args.dir, job, index, args.beat)


class _Step:
    """A program copy started by a Slurm job step of copies (`run-step`), known by the pid.json it
    writes with the token it was given: what `run --spawned TOKEN` waits for."""

    def __init__(self, tdir: str, token: str) -> None:
        self.tdir, self.token = tdir, token
        self.pid = 0
        self.seen = False

    def poll(self) -> int | None:
        record = read_json(os.path.join(self.tdir, layout.PID))
        if record is None or record.get("token") != self.token:
            return None  # not started yet
        self.pid, self.seen = record["pid"], True
        return None if ours(record) else 1


def cmd_start(args: Namespace) -> StartReply:
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    os.makedirs(args.dir, exist_ok=True)
    write_lease(args.dir, args.ttl, hold=args.timeout)  # before any supervisor reads it
    results: dict[str, TaskStarted] = {}
    pending: dict[str, tuple[TaskSpec, ForkedProcess, str]] = {}
    for task in (TaskSpec.from_arg(a) for a in args.task):
        tdir = layout.task_dir(args.dir, task.job, task.index)
        os.makedirs(tdir, exist_ok=True)
        record = read_json(os.path.join(tdir, layout.PID))
        if record is not None and ours(record) and record.get("port") == task.port:
            results[task.name] = TaskStarted(ok=True, pid=record["pid"], already=True)
            continue
        forked = fork_supervisor(args.dir, task, args.restart_limit, args.restart_backoff, env, bound=args.keep)
        pending[task.name] = (task, forked, tdir)

    # Ready means: the server wrote ready.json once it serves, AND its port accepts a connection.
    # A server that dies first has crashed (its supervisor would restart it, but a server that
    # cannot start is a mistake to report): report its log's last lines.
    begun = time.monotonic()
    deadline = begun + args.timeout
    while pending and time.monotonic() < deadline:
        for name, (task, waited, tdir) in list(pending.items()):
            code = waited.poll()
            died = (read_json(os.path.join(tdir, layout.SUPERVISOR)) or {}).get("last_exit")
            if code is not None or died:
                reason = f"server {died}" if died else f"supervisor {exit_reason(code or 0)}"
                results[name] = TaskStarted(ok=False, pid=waited.pid, reason=reason,
                                            log_tail=tail(os.path.join(tdir, layout.LOG)))
                del pending[name]
            elif os.path.exists(os.path.join(tdir, layout.READY)) and port_open(task.port):
                results[name] = TaskStarted(ok=True, pid=waited.pid)
                del pending[name]
        if pending:
            time.sleep(READY_FIRST_POLL if time.monotonic() - begun < READY_FIRST else READY_POLL)
    for name, (_, waited, tdir) in pending.items():
        results[name] = TaskStarted(ok=False, pid=waited.pid, reason=f"not serving after {args.timeout:g}s",
                                    log_tail=tail(os.path.join(tdir, layout.LOG)))
    unreachable = None
    if args.reach and all(r.ok for r in results.values()):
        if args.reach_when_told:
            # `up` starts its hosts in turns, and says "go" on this command's stdin once every
            # host serves (or anything else: no check). This reply first: the host's turn ends
            # with it, the check comes on the last line (the same reply, with its finding).
            print(encode(StartReply(tasks=results)), flush=True)
            if _told(args.reach_when_told):
                unreachable = reach(args.reach, args.reach_timeout, again=True)
        else:
            unreachable = reach(args.reach, args.reach_timeout, again=True)
    if os.path.isdir(args.dir):
        # The lease counts from when the servers serve, not from before they imported TensorFlow.
        write_lease(args.dir, args.ttl)
    return StartReply(tasks=results, unreachable=unreachable)


def _told(seconds: float) -> bool:
    """Whether the line that comes on stdin within `seconds` is "go" (read from the file
    descriptor itself: the upload before it was read so, to the byte; see dtf.hosts.control)."""
    import select

    deadline = time.monotonic() + seconds
    said = b""
    while not said.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if not select.select([0], [], [], left)[0]:
            continue
        chunk = os.read(0, 64)
        if not chunk:
            return False
        said += chunk
    return said.strip() == b"go"


def reach(targets: list[str], timeout: float, again: bool = False) -> dict[str, str]:
    """Open a TCP connection to each target ("ADDR:PORT"), all at once (up to REACH_AT_ONCE: a host
    checks 99 others in one connect time), each within `timeout` seconds; the targets it could not
    connect to, with the reason. `again`: a refused connection is tried again until the time is up
    (`up`'s mesh check from a host whose servers serve while the other hosts may still be starting
    theirs; the laptop asks again what is missed once every host serves).

    In one thread, every connection non-blocking and watched by poll(2): a thread per target was
    10 ms of a host's CPU for 29 targets against 2.4 ms so, and every host checks every other
    host's tasks (a 100-host `up` on the lab's shared cores: 99 targets on each of 100 hosts)."""
    import _socket  # (see procs.port_open)
    import errno
    import select

    deadline = time.monotonic() + timeout
    pause = max(REACH_PAUSE, len(targets) / REACH_RATE)
    why: dict[str, str] = {}  # a target's last reason: what the time running out during its next try says
    reached: set[str] = set()
    settled: set[str] = set()  # reached, or not tried again
    next_try = dict.fromkeys(targets, 0.0)
    flight: dict[int, tuple[_socket.socket, str]] = {}
    poller = select.poll()

    def failed(target: str, reason: str) -> None:
        why[target] = reason
        if again and deadline - time.monotonic() >= pause:
            next_try[target] = time.monotonic() + pause
        else:
            settled.add(target)

    def settle(target: str, code: int) -> None:
        if code == 0:
            reached.add(target)
            settled.add(target)
        else:
            failed(target, os.strerror(code))

    while len(settled) < len(targets):
        now = time.monotonic()
        flying = {target for _, target in flight.values()}  # (and those this pass leaves in flight)
        for target in targets:
            if (target in settled or target in flying or next_try[target] > now
                    or len(flight) >= REACH_AT_ONCE):
                continue
            host, _, port = target.rpartition(":")
            try:
                family, kind, proto, _, address = _socket.getaddrinfo(
                    lookup_host(host.strip("[]")), int(port), 0, _socket.SOCK_STREAM)[0]
                sock = _socket.socket(family, kind, proto)
            except (OSError, ValueError) as e:
                failed(target, getattr(e, "strerror", None) or str(e))
                continue
            sock.setblocking(False)
            code = connect(sock, address)
            if code == errno.EINPROGRESS:
                flight[sock.fileno()] = (sock, target)
                flying.add(target)
                poller.register(sock.fileno(), select.POLLOUT)
            else:
                sock.close()
                settle(target, code)
        if len(settled) == len(targets) or now >= deadline:
            break
        wake = deadline  # the next try due (one waits for a connection to end where REACH_AT_ONCE are open)
        if len(flight) < REACH_AT_ONCE:
            wake = min([next_try[t] for t in targets if t not in settled and t not in flying] + [deadline])
        for fd, _ in poller.poll(max(0, int(-(-(wake - time.monotonic()) * 1000 // 1)))):
            sock, target = flight.pop(fd)
            poller.unregister(fd)
            code = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
            sock.close()
            settle(target, code)
    for sock, _ in flight.values():
        sock.close()
    return {t: why.get(t) or f"no answer within {timeout:g}s" for t in targets if t not in reached}


def connect(sock: _socket.socket, address: Any) -> int:
    """Begin a non-blocking connect: 0 (connected), EINPROGRESS, or why not (an errno)."""
    return sock.connect_ex(address)


def cmd_serve(args: Namespace) -> None:
    from dtf_server.tfserve import serve

    serve(args.job, args.index, args.port, args.ready, full=args.full)


def cmd_fake(args: Namespace) -> None:
    from dtf_server.fake import serve

    serve(args.job, args.index, args.port, args.ready, ready_delay=args.ready_delay,
          ignore_term=args.ignore_term, ready_file=args.ready_file)


def task_status(root: str, job: str, index: int) -> TaskStatus:
    tdir = layout.task_dir(root, job, index)
    record = read_json(os.path.join(tdir, layout.PID))
    if record is None:
        return TaskStatus.dead("never started")
    sup = read_json(os.path.join(tdir, layout.SUPERVISOR)) or {}
    alive = ours(record)  # the supervisor
    server_alive = alive and ours(server_record(sup))
    port = record.get("port")
    phase = sup.get("state", "starting") if alive else "dead"
    reason = None
    if phase == "failed":
        reason = f"gave up after {sup.get('restarts')} restart(s); last exit: {sup.get('last_exit')}"
    elif not alive:
        reason = "supervisor is gone"
    return TaskStatus(
        alive=alive, phase=phase, pid=record["pid"],
        server_pid=sup.get("server_pid") if server_alive else None,
        uptime=round(time.time() - sup["server_started"], 1) if server_alive else None,
        serving=bool(server_alive and port and port_open(port)),
        restarts=sup.get("restarts", 0), last_exit=sup.get("last_exit"), reason=reason)


def cmd_status(args: Namespace) -> StatusReply:
    lease = renew(args.dir, None) if args.renew else read_lease(args.dir)
    return StatusReply(tasks={t: task_status(args.dir, *parse_name(t)) for t in args.task}, lease=lease)


def cmd_top(args: Namespace) -> None:
    """Print one TopSample line every `--interval` seconds until stdout's reader is gone (EPIPE:
    `dtf top` quit, or its SSH connection closed), the cluster's directory is gone, or `--for`
    seconds passed. It never renews the
    lease: a view left open does not keep an abandoned cluster alive."""
    from dtf_server import sample
    tasks = [(t, *parse_name(t)) for t in args.task]
    before: dict[str, sample.Usage] = {}
    then = sample.clock()
    end = then + args.for_seconds
    while True:
        statuses = {name: task_status(args.dir, job, index) for name, job, index in tasks}
        leaders = {name: s.pid for name, s in statuses.items() if s.alive and s.pid is not None}
        now_usage = sample.usage(leaders)
        now = sample.clock()
        samples = {}
        for name, status in statuses.items():
            u = now_usage.get(name)
            if u is None:
                samples[name] = TaskSample(status)
                continue
            cpu, net_in, net_out = sample.rates(before.get(name), u, now - then)
            train = read_json(layout.in_task(args.dir, *parse_name(name), layout.TRAIN))
            samples[name] = TaskSample(status, cpu=cpu, rss=u.rss, net_in=net_in, net_out=net_out,
                                       train=train if status.alive else None)
        before, then = now_usage, now
        try:
            print(encode(TopSample(tasks=samples, time=time.time(), lease=read_lease(args.dir))), flush=True)
        except BrokenPipeError:
            return
        if now >= end or not os.path.isdir(args.dir):  # the cluster is gone (`dtf down`, a lapsed lease)
            return
        time.sleep(max(0.0, min(args.interval - (sample.clock() - now), end - now)))


def cmd_renew(args: Namespace) -> RenewReply:
    return RenewReply(lease=renew(args.dir, args.ttl))


def cmd_stop(args: Namespace) -> StopReply:
    # Per running task: its process group (the supervisor's pid) and the processes to see gone,
    # supervisor and server.
    groups: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    for t in args.task:
        tdir = layout.task_dir(args.dir, *parse_name(t))
        record = read_json(os.path.join(tdir, layout.PID))
        server = server_record(read_json(os.path.join(tdir, layout.SUPERVISOR)) or {})
        members = [r for r in (record, server) if r is not None and ours(r)]
        if record and members:
            groups[t] = (record["pid"], members)
    killed: set[str] = set()

    def alive(t: str) -> bool:
        return any(ours(m) for m in groups[t][1])

    def signal_group(t: str, sig: int) -> None:
        # The group outlives its leader while any member lives, and Linux never hands out a pid
        # that is still a group's id: a group with a live member of ours is still ours.
        if alive(t):
            try:
                os.killpg(groups[t][0], sig)
            except ProcessLookupError:
                pass

    def wait(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(alive(t) for t in groups) and time.monotonic() < deadline:
            time.sleep(0.01)  # a supervisor and its server are gone 30-80 ms after TERM: `down` waits on this

    for t in groups:
        signal_group(t, signal.SIGTERM)
    wait(args.grace)
    for t in groups:
        if alive(t):
            signal_group(t, signal.SIGKILL)
            killed.add(t)
    wait(5)
    stopped = {t: TaskStopped(was_running=t in groups, killed=t in killed, gone=t not in groups or not alive(t))
               for t in args.task}
    cleaned = None
    if args.clean and all(s.gone for s in stopped.values()):
        cleaned = cmd_clean(Namespace(dir=args.dir, keep_logs=args.keep_logs, if_unused=False))
    return StopReply(tasks=stopped, cleaned=cleaned)


def cmd_reach(args: Namespace) -> ReachReply:
    """Open a TCP connection to each target (in parallel), each within --timeout seconds."""
    unreachable = reach(args.to, args.timeout)
    if args.dir:
        renew(args.dir, None)  # `up` asks last: whoever asks is using the cluster
    return ReachReply(unreachable=unreachable)


def cmd_fence(args: Namespace) -> FenceReply:
    from dtf_server import fence
    if args.remove:
        return fence.remove(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    allow = list(args.allow)
    launcher = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") if args.allow_launch_node else None
    if launcher:  # the login host whose srun started this step: it carries dtf's connections to the tasks
        allow.append(launcher)
    return fence.apply(args.dir, args.port, allow)


def cmd_clean(args: Namespace) -> CleanReply:
    """What `down` ends with on every host (`stop --clean`): fence and shutil (with re, through
    fnmatch) are imported only where there is a fence to remove or a directory to remove whole,
    which most clusters never have (their imports were 20 ms of a host's `down`)."""
    removed: list[str] = []
    if not os.path.isdir(args.dir):
        return CleanReply(removed=removed)
    if args.if_unused and running_tasks(args.dir):
        return CleanReply(removed=removed, in_use=True)  # another dtf's tasks live here: not ours
    if os.path.exists(os.path.join(args.dir, layout.FENCE)):  # the firewall rules first: they outlive no cluster
        from dtf_server import fence

        fenced = fence.remove(args.dir)
        if fenced.error:
            raise SystemExit(f"cannot remove the TF ports' firewall rules: {fenced.error}")
    for name in sorted(os.listdir(args.dir)):
        path = os.path.join(args.dir, name)
        if os.path.isdir(path) and not os.path.islink(path) and name != "__pycache__":
            if ours(read_json(os.path.join(path, layout.PID))):
                raise SystemExit(f"refusing to clean {path}: its server is still running")
            for entry in os.listdir(path):
                if args.keep_logs and entry == layout.LOG:
                    continue
                target = os.path.join(path, entry)
                if os.path.isdir(target) and not os.path.islink(target):
                    _rmtree(target)  # written by the server (a relative path in a program)
                else:
                    os.unlink(target)
                removed.append(target)
            if not os.listdir(path):
                os.rmdir(path)
        elif (layout.is_launcher(name) or layout.is_helpers(name) or name in (layout.LEASE, layout.EXPIRE_LOCK)
              or ".tmp-" in name):
            os.unlink(path)  # every launcher version (and dtf's package), and uploads that never completed
            removed.append(path)
    if os.path.isdir(pycache := os.path.join(args.dir, "__pycache__")):
        _rmtree(pycache, ignore_errors=True)
    if not os.listdir(args.dir):
        os.rmdir(args.dir)
    return CleanReply(removed=removed)


def _rmtree(path: str, ignore_errors: bool = False) -> None:
    import shutil  # (see cmd_clean)

    shutil.rmtree(path, ignore_errors=ignore_errors)


def cmd_sync(args: Namespace) -> SyncReply:
    """A synced tree: is WORKDIR/.cache/sync/HASH there (`--free-port`: and a port free here);
    with --receive, make it from stdin, or from another host's relay (`--from ADDR:PORT`), and
    pass it on to `--children` hosts as it arrives (`--serve PORT`: see dtf_server.receive)."""
    from dtf_server import receive
    if receive.present(args.dir, args.hash) or not args.receive:
        return SyncReply(present=receive.present(args.dir, args.hash),
                         port=receive.free_port() if args.free_port else 0)
    token = args.token
    relay = None
    if args.serve:
        try:
            relay = receive.Relay(args.serve, args.children, token)
        except OSError:
            relay = None  # the port was taken meanwhile: the children fail, and the laptop sends to them
    complete = False
    try:
        wait = receive.ACCEPT_WAIT if args.wait is None else args.wait
        source = receive.connect(args.source, token, wait=wait) if args.source else sys.stdin.buffer
        if relay is not None:
            relay.accept(wait=wait)
        try:
            received = receive.receive(args.dir, args.hash, source, relay.write if relay is not None else None)
        finally:
            source.close()
        complete = True
    except receive.ReceiveError as e:
        raise SystemExit(f"sync: {e}")
    finally:
        if relay is not None:
            relay.close(complete)
    return SyncReply(present=True, received=received, passed=relay.passed if relay is not None else 0)


def parser() -> Parser:
    """The launcher's parser: every command's options (dtf_server.options)."""
    p = Parser("launcher", EXIT_USAGE, __doc__)  # (not 2: see protocol.EXIT_NO_LAUNCHER)
    add = p.add_parser

    c = add("check")
    c.add_argument("--dir")
    c.add_argument("--port", type=int, action="append", default=[])
    c.add_argument("--env")
    c.add_argument("--wheels")
    c = add("env")
    for option in ("--env", "--wheels", "--uv", "--requirements"):
        c.add_argument(option, required=True)
    c = add("purge")
    c.add_argument("--workdir", required=True)
    c = add("serve-wheels")
    c.add_argument("--dir", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--file", action="append", default=[])
    c.add_argument("--idle", type=float, default=15.0)
    c.add_argument("--limit", type=float, default=900.0)
    c = add("fetch-wheels")
    c.add_argument("--from", dest="source", required=True)
    c.add_argument("--dir", required=True)
    c.add_argument("--file", action="append", default=[])
    c.add_argument("--wait", type=float, default=30.0)
    c.add_argument("--timeout", type=float, default=30.0)
    for name in ("start", "check-start"):
        c = add(name)
        c.add_argument("--dir", required=True)
        if name == "check-start":
            c.add_argument("--port", type=int, action="append", default=[])
            c.add_argument("--tensorflow", default="")  # the laptop's version ("": not compared)
            c.add_argument("--fresh", action="store_true")  # a task of this cluster running there refuses
            c.add_argument("--gpus", type=int, default=0)  # GPUs the tasks are given (highest id + 1)
        c.add_argument("--task", action="append", default=[])
        c.add_argument("--restart-limit", type=int, default=Defaults.RESTART_LIMIT)
        c.add_argument("--restart-backoff", type=float, default=Defaults.RESTART_BACKOFF)
        c.add_argument("--env", action="append", default=[])
        c.add_argument("--timeout", type=float, default=Defaults.START_TIMEOUT)
        c.add_argument("--ttl", type=float, default=Defaults.TTL)
        # `up`'s mesh check in the same call: once these servers serve, the other hosts' tasks.
        c.add_argument("--reach", action="append", default=[])
        c.add_argument("--reach-timeout", type=float, default=5.0)
        # The mesh check once told: see cmd_start.
        c.add_argument("--reach-when-told", type=float, default=0.0)
        # A Slurm node's job step: after the reply, stay until the supervisors forked here end.
        c.add_argument("--keep", action="store_true")
    for name in ("serve", "fake"):
        c = add(name)
        c.add_argument("--job", required=True)
        c.add_argument("--index", type=int, required=True)
        c.add_argument("--port", type=int, required=True)
        c.add_argument("--ready", required=True)
        if name == "serve":
            c.add_argument("--full", action="store_true")  # `import tensorflow`: see dtf_server.tfserve
        if name == "fake":
            c.add_argument("--ready-delay", type=float, default=0.0)
            c.add_argument("--ignore-term", action="store_true")
            c.add_argument("--ready-file")
    c = add("run")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", action="append", default=[])
    c.add_argument("--env", action="append", default=[])
    c.add_argument("--clear-output", action="store_true")
    c.add_argument("--spawned", default="")  # Slurm: `run-step` started the copies with this token
    c = add("run-step")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", action="append", default=[])
    c.add_argument("--host", action="append", default=[])
    c.add_argument("--env", action="append", default=[])
    c.add_argument("--token", required=True)
    c.add_argument("--clear-output", action="store_true")
    c = add("supervise-program")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", required=True)
    c = add("follow")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", required=True)
    c.add_argument("--beat", type=float, default=2.0)
    c = add("top")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", action="append", default=[])
    c.add_argument("--interval", type=float, default=1.0)
    c.add_argument("--for", dest="for_seconds", type=float, default=24 * 3600.0)
    c = add("renew")
    c.add_argument("--dir", required=True)
    c.add_argument("--ttl", type=float, default=None)
    for name in ("status", "stop"):
        c = add(name)
        c.add_argument("--dir", required=True)
        c.add_argument("--task", action="append", default=[])
        if name == "status":
            c.add_argument("--renew", action="store_true")
        else:
            c.add_argument("--grace", type=float, default=Defaults.STOP_GRACE)
            # `down` in one round trip: once every task is gone, `clean` as well.
            c.add_argument("--clean", action="store_true")
            c.add_argument("--keep-logs", action="store_true")
    c = add("reach")
    c.add_argument("--dir")
    c.add_argument("--to", action="append", default=[])
    c.add_argument("--timeout", type=float, default=3.0)
    c = add("fence")
    c.add_argument("--dir", required=True)
    c.add_argument("--port", type=int, action="append", default=[])
    c.add_argument("--allow", action="append", default=[])
    c.add_argument("--allow-launch-node", action="store_true")  # Slurm: and the step's srun host
    c.add_argument("--remove", action="store_true")
    c = add("sync")
    c.add_argument("--dir", required=True)
    c.add_argument("--hash", required=True)
    c.add_argument("--receive", action="store_true")
    c.add_argument("--free-port", action="store_true")
    c.add_argument("--from", dest="source")
    c.add_argument("--serve", type=int, default=0)
    c.add_argument("--children", type=int, default=0)
    c.add_argument("--token", default="")
    c.add_argument("--wait", type=float)  # for the parent, and the children (default: receive.ACCEPT_WAIT)
    c = add("clean")
    c.add_argument("--dir", required=True)
    c.add_argument("--keep-logs", action="store_true")
    c.add_argument("--if-unused", action="store_true")
    return p


COMMANDS: dict[str, Any] = {
    "check": cmd_check, "check-start": cmd_check_start,
    "start": cmd_start,
    "serve": cmd_serve, "fake": cmd_fake, "status": cmd_status, "renew": cmd_renew, "stop": cmd_stop,
    "clean": cmd_clean, "reach": cmd_reach, "fence": cmd_fence, "sync": cmd_sync, "env": cmd_env, "purge": cmd_purge,
    "serve-wheels": cmd_serve_wheels, "fetch-wheels": cmd_fetch_wheels, "run": cmd_run, "run-step": cmd_run_step,
    "supervise-program": cmd_supervise_program, "follow": cmd_follow, "top": cmd_top,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    for attr in ("dir", "ready", "env", "wheels", "uv", "requirements", "workdir"):
        if isinstance(getattr(args, attr, None), str):  # (start's --env is a list of variables)
            setattr(args, attr, os.path.expanduser(getattr(args, attr)))
    reply: Reply | None = COMMANDS[args.command](args)
    if reply is None:  # supervise, serve, fake, supervise-program, follow, top: they run until done
        return 0
    print(encode(reply), flush=True)
    if getattr(args, "keep", False):
        keep()
    if isinstance(reply, StartReply) and not reply.ok:
        return EXIT_START_FAILED
    return 0


def keep() -> None:
    """`start --keep`: this launcher is a Slurm node's job step (dtf.hosts.slurmstep.start_kept),
    which lasts as long as its main process: Slurm would end the step, the supervisors forked here
    with it, if this one exited. It stays, silent (the reply was its last word: the login host
    reads until then), until every supervisor it forked has ended (`down`, the lease, a failed
    start's rollback); Slurm signals it with the rest of the step when the job ends."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    name_process("dtf step")
    while True:
        try:
            os.wait()  # (a signal's EINTR is retried by Python itself: PEP 475)
        except ChildProcessError:
            return
