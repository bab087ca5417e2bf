"""The launcher's commands that start a host's servers: `check` (is the host fit), `start`
(a supervisor forked per task, which restarts its server when it dies; then, with `--reach`,
the mesh check), `check-start` (`up`'s both in one call), and the servers themselves, `serve`
(a tf.distribute.Server) and `fake` (a server without TensorFlow, for tests)."""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable

from dtf_server import envs, fake, firewall
from dtf_server.network import reach
from dtf_server.procs import (
    die_with_parent,
    launcher,
    leave,
    nvidia_gpus,
    ours,
    platform_info,
    port_busy,
    port_open,
    proc_start_ticks,
    read_json,
    settle_child,
    tail,
    variables,
    write_json,
)
from dtf_server.protocol import (
    CheckReply,
    CheckRequest,
    CheckStartRequest,
    FakeRequest,
    Firewall,
    FirewallReply,
    Layout,
    ServeRequest,
    StartReply,
    StartRequest,
    TaskSpec,
    TaskStarted,
    encode,
    exit_reason,
    parse,
    tf_version,
)
from dtf_server.supervisor import ForkedProcess, Supervisor, read_lease, running_tasks, write_lease

# A start looks at its servers READY_FIRST_POLL apart for its first READY_FIRST seconds (a server
# that starts at once is seen serving without waiting a whole READY_POLL), then READY_POLL apart.
READY_POLL = 0.05
READY_FIRST_POLL, READY_FIRST = 0.01, 1.0


def cmd_check(request: CheckRequest) -> CheckReply:
    client = os.environ.get("SSH_CONNECTION", "").split()
    machine, system, libc = platform_info()
    env_ready, wheels, free = None, [], -1
    if request.env:  # a managed environment's (dtf_server.envs)
        env_ready = envs.ready(request.env)
        if not env_ready:  # what a build would need: only looked at when the environment is not complete
            wheels, free = envs.wheels_in(request.wheels), envs.free_space(request.wheels or "")
    return CheckReply(python=sys.version.split()[0], executable=sys.executable, tensorflow=tf_version(),
                      busy=[p for p in request.port if port_busy(p)],
                      client_address=client[0] if client else None,
                      running=running_tasks(request.dir) if request.dir else [],
                      machine=machine, system=system, libc=libc, env_ready=env_ready, gpus=nvidia_gpus(),
                      wheels=wheels, free=free)


def check_passes(check: CheckReply, tensorflow: str, fresh: bool, gpus: int = 0) -> bool:
    """Whether `up` goes on to start the host's servers after this check (the client decides the
    same from the CheckReply, and says why not). `gpus`: how many GPUs the host's tasks are given
    (its highest id + 1): a host whose NVIDIA driver lists fewer fails (one without a driver passes)."""
    return (check.tensorflow is not None and (not tensorflow or check.tensorflow == tensorflow)
            and not check.busy and not (fresh and check.running)
            and not (gpus and check.gpus is not None and check.gpus < gpus))


def cmd_check_start(request: CheckStartRequest) -> StartReply | None:
    """`up`'s check and start in one launcher call (one python start, one round trip): print the
    CheckReply; if the host passes it (its TensorFlow is `--tensorflow`, the ports are free, with
    `--fresh` no task of this cluster runs there, and it has the `--gpus` it is given), start the
    servers and answer their StartReply (the last line, as every command's reply)."""
    check = cmd_check(CheckRequest(dir=request.dir, port=request.port))
    print(encode(check), flush=True)
    if not check_passes(check, request.tensorflow, request.fresh, request.gpus):
        return None
    return cmd_start(request)



def fresh_task_dir(root: str, task: TaskSpec) -> str:
    """The task's directory, without what an earlier run of it left that a start waits on."""
    tdir = Layout.task_dir(root, task.job, task.index)
    os.makedirs(tdir, exist_ok=True)
    for stale in (Layout.READY, Layout.SUPERVISOR):  # left by an earlier run
        if os.path.exists(os.path.join(tdir, stale)):
            os.unlink(os.path.join(tdir, stale))
    return tdir


def record_supervisor(tdir: str, task: TaskSpec, pid: int) -> None:
    """The task's pid.json: its supervisor, as `ours` knows it again."""
    write_json(os.path.join(tdir, Layout.PID),
               {"pid": pid, "start_ticks": proc_start_ticks(pid), "job": task.job,
                "index": task.index, "port": task.port, "started": time.time()})


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
    found = shutil.which(argv[0]) if argv else None  # (as exec finds it on the PATH)
    if (len(argv) < 3 or argv[2] not in SERVER_COMMANDS or found is None or os.path.abspath(found) != sys.executable
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
        return run_server(command)

    return run, command[0]


def run_server(argv: list[str]) -> int:
    """A server's command line (`serve ...` or `fake ...`), run in this process: what a
    supervisor's fork of itself runs (`in_process`), without the launcher's own command line."""
    request = parse(argv)
    if isinstance(request, ServeRequest):
        cmd_serve(request)
    elif isinstance(request, FakeRequest):
        cmd_fake(request)
    else:
        raise SystemExit(f"dtf: not a server's command: {request.command}")
    return 0


def fork_supervisor(root: str, task: TaskSpec, limit: int, backoff: float, env: dict[str, str],
                    bound: bool = False) -> ForkedProcess:
    """Start a task's supervisor detached (its own session: it survives the SSH session, and one
    process group holds it and its server), logging to the task's log, and record it in pid.json.

    Forked from this launcher, not a python of its own: it has every module it needs already.
    Its command line stays this `start`'s; its name (`ps -e`, top) says what it is: `dtf ps:0`.

    `bound` (`start --keep`, a Slurm job step): it ends with this launcher, however that ends (TERM
    when it dies: it stops its server and goes). Slurm ends a step by its process group where the
    site tracks processes by group (proctrack/pgid), and a supervisor has a session of its own."""
    tdir = fresh_task_dir(root, task)
    parent = os.getpid()
    log = os.open(os.path.join(tdir, Layout.LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
            traceback.print_exc()
        finally:
            leave(code)
    os.close(log)
    record_supervisor(tdir, task, pid)
    return ForkedProcess(pid)




def cmd_start(request: StartRequest) -> StartReply:
    env = dict(os.environ)
    env.update(variables(request.env))
    os.makedirs(request.dir, exist_ok=True)
    write_lease(request.dir, request.ttl, hold=request.timeout)  # before any supervisor reads it (and `in_use`)
    rules = close_ports(request.dir, request.firewall)
    if rules is not None and rules.error and request.firewall.mode == "members":
        return StartReply(tasks={}, firewall=rules, refused=f"firewall: members is not possible there: {rules.error}")
    results: dict[str, TaskStarted] = {}
    pending: dict[str, tuple[TaskSpec, ForkedProcess, str]] = {}
    for task in request.task:
        tdir = Layout.task_dir(request.dir, task.job, task.index)
        os.makedirs(tdir, exist_ok=True)
        record = read_json(os.path.join(tdir, Layout.PID))
        if record is not None and ours(record) and record.get("port") == task.port:
            results[task.name] = TaskStarted(ok=True, pid=record["pid"], already=True,
                                             server_pid=_server_pid(tdir))
            continue
        forked = fork_supervisor(request.dir, task, request.restart_limit, request.restart_backoff, env,
                                 bound=request.keep)
        pending[task.name] = (task, forked, tdir)

    if rules is not None and rules.error is None:
        firewall.sweep(request.dir, in_use)  # others' stale rules, while the servers start
    # Ready means: the server wrote ready.json once it serves, AND its port accepts a connection
    # (AND its supervisor recorded it: the pid `up` shows).
    # A server that dies first has crashed (its supervisor would restart it, but a server that
    # cannot start is a mistake to report): report its log's last lines.
    begun = time.monotonic()
    deadline = begun + request.timeout
    while pending and time.monotonic() < deadline:
        for name, (task, waited, tdir) in list(pending.items()):
            code = waited.poll()
            died = (read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {}).get("last_exit")
            if code is not None or died:
                reason = f"server {died}" if died else f"supervisor {exit_reason(code or 0)}"
                results[name] = TaskStarted(ok=False, pid=waited.pid, reason=reason,
                                            log_tail=tail(os.path.join(tdir, Layout.LOG)))
                del pending[name]
            elif os.path.exists(os.path.join(tdir, Layout.READY)) and port_open(task.port):
                # A server forked from a supervisor that imported TensorFlow already can serve
                # before its supervisor recorded it: ready once the record names it too.
                server_pid = _server_pid(tdir)
                if server_pid is not None:
                    results[name] = TaskStarted(ok=True, pid=waited.pid, server_pid=server_pid)
                    del pending[name]
        if pending:
            time.sleep(READY_FIRST_POLL if time.monotonic() - begun < READY_FIRST else READY_POLL)
    for name, (_, waited, tdir) in pending.items():
        results[name] = TaskStarted(ok=False, pid=waited.pid, reason=f"not serving after {request.timeout:g}s",
                                    log_tail=tail(os.path.join(tdir, Layout.LOG)))
    unreachable = None
    if request.reach and all(r.ok for r in results.values()):
        if request.reach_when_told:
            # `up` starts its hosts in turns, and says "go" on this command's stdin once every
            # host serves (or anything else: no check). This reply first: the host's turn ends
            # with it, the check comes on the last line (the same reply, with its finding).
            print(encode(StartReply(tasks=results, firewall=rules)), flush=True)
            if _told(request.reach_when_told):
                unreachable = reach(request.reach, request.reach_timeout, again=True)
        else:
            unreachable = reach(request.reach, request.reach_timeout, again=True)
    if os.path.isdir(request.dir):
        # The lease counts from when the servers serve, not from before they imported TensorFlow.
        write_lease(request.dir, request.ttl)
    return StartReply(tasks=results, unreachable=unreachable, firewall=rules)


def _server_pid(tdir: str) -> int | None:
    """The task's server's pid, as its supervisor recorded it (None while it has none)."""
    pid = (read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {}).get("server_pid")
    return pid if isinstance(pid, int) else None


def close_ports(root: str, rules: Firewall) -> FirewallReply | None:
    """`--firewall auto|members`: close the host's TF ports (`--firewall-port`) to all but `--allow`,
    loopback, the SSH client (`--allow-client`: the laptop, as this host sees it) and a Slurm
    step's srun host (`--allow-launch-node`), before any server listens. None: not asked."""
    if rules.mode not in ("auto", "members"):
        return None
    allow = list(rules.allow)
    client = os.environ.get("SSH_CONNECTION", "").split()
    if rules.client and client:
        allow.append(client[0])
    launcher = os.environ.get("SLURM_LAUNCH_NODE_IPADDR") if rules.launch_node else None
    if launcher:  # the login host whose srun started this step: it carries dtf's connections to the tasks
        allow.append(launcher)
    return firewall.apply(root, sorted(set(rules.ports)), allow)


def in_use(root: str) -> bool:
    """Whether a cluster's directory is in use: a task's supervisor lives there, or a start holds
    its lease (`start` writes it, ahead of now, before anything else). A directory whose
    supervisors were all killed (SIGKILL, a reboot) is not."""
    try:
        if running_tasks(root):
            return True
    except OSError:  # (removed meanwhile, by its `clean`)
        return False
    lease = read_lease(root)
    return lease is not None and lease.renewed > time.time()


def _told(seconds: float) -> bool:
    """Whether the line that comes on stdin within `seconds` is "go" (read from the file
    descriptor itself: the upload before it was read so, to the byte; see dtf.hosts.control)."""
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


def cmd_serve(request: ServeRequest) -> None:
    from dtf_server.tfserve import serve  # (TensorFlow's server library: in a server only)

    serve(request.job, request.index, request.port, request.ready, full=request.full)


def cmd_fake(request: FakeRequest) -> None:
    fake.serve(request.job, request.index, request.port, request.ready, ready_delay=request.ready_delay,
               ignore_term=request.ignore_term, ready_file=request.ready_file)
