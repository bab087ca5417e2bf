"""`dtf train --collective`: the program runs on the hosts, one copy per worker task, under
MultiWorkerMirroredStrategy (worker 0 is the chief; gradients are all-reduced among the copies).

What happens, in order:
1. The program's directory is sent to every host as `dtf sync` sends it (dtf.files.sync: once per
   content hash, to WORKDIR/.cache/sync/HASH); ps tasks are not used (the strategy has none) and say so.
2. The worker servers of `dtf up` give their ports to the copies: they are stopped, and started
   again when the run ends (the cluster is left as it was found).
3. Each host's launcher starts its copies (`run`): each with its task's TF_CONFIG, in its own
   process group, supervised like a server, logging to its task's log, working in its output
   directory (dtf_server.program). One follower per copy streams its output here, prefixed
   `[worker:1 h2] `, without TensorFlow's C++ chatter (dtf.program.noise, as under `dtf train`)
   unless `verbose`.
4. A start deadline: every copy must have joined (dtf.program.hooks.collective) within `join_timeout`,
   else dtf stops them all and names the tasks that never joined, and why when it can tell.
   (Steps 4 and 5 are dtf.collective.watch: one attempt followed through named states.)
5. The first copy that fails (or whose host is lost) stops all of them (TERM, then KILL), and
   dtf names it with its host and its last lines. With attempts left and a failure that was not
   the program's own (a copy killed, a host lost), all copies start again; tf-keras
   BackupAndRestore resumes them from `<backup_dir>/chief`, which dtf copies from the chief to
   every other worker first (the hosts need not share a filesystem).
6. The chief's output directory comes back to `--output` (else ./dtf-output) after every
   attempt, failed ones too; the other workers' directories are removed at the end.
Ctrl-C sends TERM to every copy (TensorFlow's PreemptionCheckpointHandler saves then), KILL
after the grace, brings the chief's output back, and leaves nothing running on any host.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtf.cluster import gpus
from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.cluster.state import Record
from dtf.collective import follow, remote_files
from dtf.collective.watch import Attempt, Watch, say

# How an attempt ends, named here too (callers and tests know them as dtf.collective.run's).
from dtf.collective.watch import Failure as Failure
from dtf.collective.watch import StartDeadline as StartDeadline
from dtf.collective.watch import exit_code as exit_code
from dtf.collective.watch import lost_or_killed as lost_or_killed
from dtf.collective.watch import prefix as prefix
from dtf.errors import HostFailure, UsageError
from dtf.files import shipping, sync
from dtf.hostops import launcher, status, stop, syncing
from dtf.hostops.lease import LeaseKeeper
from dtf.hostops.lifecycle import ctrl_c_sets
from dtf.hostops.parallel import HostOps
from dtf.hostops.repair import answered_or_moved
from dtf.hostops.start import Starter
from dtf.hosts.base import HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.program.train import NoFigures, RunFigures
from dtf.providers.choose import provider_for
from dtf_server.protocol import Defaults, Layout, ReachReply, RunRequest, RunStepRequest, StartReply, TaskSpec

JOIN_TIMEOUT = 300.0  # seconds every copy gets to import TensorFlow and join the others
STOP_GRACE = 10.0  # seconds between TERM and KILL when the copies are stopped
REACH_TIMEOUT = 3.0


# -- the plan of a collective run (pure) --------------------------------------------------------
def workers(plan: Plan) -> list[TaskPlan]:
    return [t for t in plan.tasks() if t.job == "worker"]


def tf_configs(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each worker task's TF_CONFIG: the workers only (worker 0 is the chief)."""
    cluster = {"worker": [t.address for t in workers(plan)]}
    return {t.name: {"cluster": cluster, "task": {"type": "worker", "index": t.index}} for t in workers(plan)}


def copy_argv(plan: Plan, task: TaskPlan, program: str, args: list[str], attempt: int,
              synced: dict[str, str] | None = None) -> list[str]:
    """What a copy's supervisor runs: `env` sets the task's own variables (the launcher's `run`
    sets the host's), then dtf's runner runs the program as `python PROGRAM ARGS` would.
    `synced`: name -> a tree's path relative to a task's directory (dtf.files.sync), for dtf.synced()."""
    hp = plan.host_of(task)
    env = {"TF_CONFIG": json.dumps(tf_configs(plan)[task.name], separators=(",", ":")),
           "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1", "DTF_COLLECTIVE": "1",
           "DTF_CLUSTER": plan.cluster, "DTF_ATTEMPT": str(attempt),
           # Its training figures, in its task's directory: the host's `top` reads them (dtf top).
           "DTF_FIGURES": "..",
           # A copy works in its task's output directory, one below the task's directory.
           "DTF_SYNCED": json.dumps({name: posixpath.join("..", path) for name, path in (synced or {}).items()})}
    position = hp.spec.worker_ports.index(task.port)
    env.update(gpus.task_env(hp.spec.gpus, task.job, position, len(hp.spec.worker_ports)))
    if hp.spec.allocated and hp.spec.gpus is not None:
        # SlurmClusterResolver counts a node's GPUs in CUDA_VISIBLE_DEVICES, which holds only this
        # copy's share: dtf.program.hooks.collective makes it count the node's
        # (dtf.providers.slurm.commands.gpu_note).
        env[gpus.NODE_GPUS_ENV] = str(len(hp.spec.gpus))
    return [*gpus.env_prefix(env), hp.python, "-m", "dtf.program.runner", program, *args]


def run_env(hp: HostPlan) -> list[str]:
    """The variables (NAME=VALUE) of a `run`: the host's, and where dtf's package is (ship)."""
    return [f"{k}={v}" for k, v in (*hp.env, (Layout.HELPERS_ENV, hp.helpers))]


def run_argv(hp: HostPlan, specs: list[TaskSpec], fresh: bool, spawned: str = "") -> list[str]:
    """The launcher's `run` on a host: start its copies; `spawned` (Slurm): one job step started
    them (`run_step_argv`), wait for them."""
    return hp.launcher_argv(RunRequest(dir=hp.root, env=run_env(hp), clear_output=fresh, spawned=spawned,
                                       task=specs))


def run_step_argv(hp: HostPlan, specs: list[tuple[str, TaskSpec]], fresh: bool, token: str) -> list[str]:
    """Slurm: what every task of the one job step of copies runs (the launcher's `run-step`): every
    copy's (host, spec) in worker order; the step's task SLURM_PROCID runs the copy of that worker.
    The nodes share their settings (python, workdir, environment), so one argv serves them all."""
    return hp.launcher_argv(RunStepRequest(dir=hp.root, env=run_env(hp), clear_output=fresh, token=token,
                                           task=[s for _, s in specs], host=[host for host, _ in specs]))


def out_dir(hp: HostPlan, task: TaskPlan) -> str:
    return f"{task.dir}/{Layout.OUT}"


def host_program_wait() -> float:
    """Seconds the launcher's `run --spawned` waits for a job step's copies."""
    return Defaults.RUN_STEP_WAIT


def check_plan(plan: Plan) -> list[str]:
    """The notes to print: ps tasks are not used (an inventory always has a worker); what the
    provider notes of the copies (on Slurm: GPUs that SlurmClusterResolver would split otherwise
    than dtf)."""
    notes = []
    ps = [f"{t.name} ({t.host})" for t in plan.tasks() if t.job == "ps"]
    if ps:
        notes.append(f"--collective: {', '.join(ps)} not used (MultiWorkerMirroredStrategy has no parameter "
                     f"servers; they keep running)")
    return notes + [f"--collective: {note}" for note in provider_for(plan).copies_notes()]


def never_joined(plan: Plan, pending: list[TaskPlan], serving: dict[str, bool],
                 unreachable: dict[str, list[str]]) -> str:
    """The start deadline's message: which tasks never joined, and why when it can tell.
    `serving`: task -> its port accepts connections on its own host; `unreachable`: task -> the
    hosts that cannot connect to it."""
    whys = []
    for t in pending:
        if not serving.get(t.name, False):
            whys.append(f"{t.name} ({t.host}) never listened on port {t.port} (see `dtf logs {t.name}`)")
        elif unreachable.get(t.name):
            whys.append(f"{t.name} ({t.host}) is not reachable at {t.address} from "
                        f"{', '.join(unreachable[t.name])} (a firewall?)")
        else:
            whys.append(f"{t.name} ({t.host}) waited for the others")
    return "; ".join(whys)


class CollectiveRun:
    def __init__(self, record: Record, program: Path, args: list[str], output: Path,
                 join_timeout: float = JOIN_TIMEOUT, grace: float = STOP_GRACE,
                 connect_timeout: float = CONNECT_TIMEOUT, host_lost: float = follow.HOST_LOST,
                 taken_down: Callable[[], bool] = lambda: False, verbose: bool = False) -> None:
        self.record, self.plan = record, record.plan
        self.program, self.args, self.output = program, args, output
        self.join_timeout, self.grace, self.host_lost = join_timeout, grace, host_lost
        self.connect_timeout = connect_timeout
        self.verbose = verbose  # TensorFlow's C++ INFO and WARNING lines too
        self.ops = HostOps(self.plan, connect_timeout=connect_timeout)
        self.workers = workers(self.plan)
        self.hosts = [hp for hp in self.plan.hosts if any(t.job == "worker" for t in hp.tasks)]
        self.only = {hp.name: {t.name for t in hp.tasks if t.job == "worker"} for hp in self.hosts}
        self.taken_down = taken_down
        self.remote_program: dict[str, str] = {}
        self.figures: RunFigures | NoFigures = NoFigures()  # what `dtf top` shows of the run

    def on(self, record: Record) -> CollectiveRun:
        """This run on the hosts of `record` (tasks moved to a spare: dtf.hostops.repair), with the
        program shipped to them."""
        run = CollectiveRun(record, self.program, self.args, self.output, join_timeout=self.join_timeout,
                            grace=self.grace, connect_timeout=self.connect_timeout, host_lost=self.host_lost,
                            taken_down=self.taken_down, verbose=self.verbose)
        run.figures = self.figures
        run.ship()
        return run

    # -- steps on the hosts ----------------------------------------------------------------------
    def ship(self) -> None:
        """The program's directory to every worker host as `dtf sync` sends it: once per content
        hash (its .gitignore files apply), to WORKDIR/.cache/sync/HASH."""
        try:
            p = sync.pack(self.program.parent, "program")
        except sync.SyncError as e:
            raise UsageError(f"--collective: {e}")
        outcomes = syncing.send(self.ops, [p], self.hosts)
        failed = {h: o.reason for h, o in outcomes.items() if not o.ok}
        if failed:
            raise HostFailure("sending the program", failed)

        def helpers(hp: HostPlan) -> None:  # dtf's own package, which the copies import
            with self.ops.runner(hp) as t:
                t.put_bytes(shipping.helpers_bytes(), hp.root, shipping.helpers_name())

        failed = {h: o.reason for h, o in self.ops.each_host(helpers, self.hosts).items() if not o.ok}
        if failed:
            raise HostFailure("sending dtf's package", failed)
        self.remote_program = {hp.name: posixpath.join(p.synced.host_path(hp), self.program.name)
                               for hp in self.hosts}

    def stop(self, what: str) -> dict[str, str]:
        """Stop every worker task (servers or copies): TERM, KILL after the grace. Failures by host."""
        outcomes = stop.stop_tasks(self.ops, self.only, grace=self.grace)
        return {h: o.reason for h, o in outcomes.items() if not o.ok}

    def specs(self, hp: HostPlan, attempt: int) -> list[TaskSpec]:
        """The copies of a host's worker tasks."""
        return [TaskSpec(job=t.job, index=t.index, port=t.port,
                         argv=copy_argv(self.plan, t, self.remote_program[hp.name], self.args, attempt,
                                        {n: x.task_path for n, x in self.record.synced.items()}))
                for t in hp.tasks if t.job == "worker"]

    def start_step(self, attempt: int) -> str:
        """Where the provider starts every copy as ONE step of the hosts' allocation (a Slurm job
        step, `srun --ntasks=N`, as the user's own srun would: Provider.start_copies), the token
        the copies' pid.json carry; "" where each host's launcher starts its own."""
        import uuid

        token = uuid.uuid4().hex[:16]
        specs = {s.name: (hp.name, s) for hp in self.hosts for s in self.specs(hp, attempt)}
        ordered = [specs[t.name] for t in sorted(self.workers, key=lambda t: t.index)]
        first = self.hosts[0]
        started = self.ops.provider.start_copies(self.hosts, len(first.spec.worker_ports),
                                                 run_step_argv(first, ordered, attempt == 1, token))
        return token if started else ""

    def start_copies(self, attempt: int) -> None:
        token = self.start_step(attempt)

        def one(hp: HostPlan) -> StartReply:
            with self.ops.runner(hp) as t:
                return launcher.ask(t, hp, StartReply, run_argv(hp, self.specs(hp, attempt), attempt == 1, token),
                                    "starting the program", 60 + (host_program_wait() if token else 0))

        outcomes = self.ops.each_host(one, self.hosts)
        failed = {h: o.reason for h, o in outcomes.items() if not o.ok}
        for h, o in outcomes.items():
            if o.ok:
                for name, s in o.value.tasks.items():
                    if not s.ok:
                        failed[h] = f"{name}: {s.reason}"
        if failed:
            self.stop("rollback")
            raise HostFailure("starting the program", failed)

    def restore_servers(self) -> None:
        """Start the worker servers of `dtf up` again: the cluster as the run found it."""
        outcomes = Starter(self.ops).up(self.only)
        failed = {h: o.reason for h, o in outcomes.items() if not o.ok}
        if failed:
            say("could not start the worker servers again (`dtf up` restarts them): "
                + "; ".join(f"{h}: {r}" for h, r in failed.items()))

    def fetch_chief(self, into: Path) -> int:
        chief = self.workers[0]
        hp = self.plan.host_of(chief)
        with self.ops.runner(hp) as t:
            return remote_files.fetch_tree(t, out_dir(hp, chief), into)

    def copy_backup(self, chief_out: Path) -> None:
        """Before a restart: the chief's output directory (its BackupAndRestore backup in it) to
        every other worker's, so that each restores from `<backup_dir>/chief`."""
        data = remote_files.pack(chief_out) if any(chief_out.iterdir()) else b""
        if not data:
            return

        def one(hp: HostPlan) -> None:
            with self.ops.runner(hp) as t:
                for task in hp.tasks:
                    if task.job == "worker" and task.index != 0:
                        remote_files.send_tree(t, hp, data, out_dir(hp, task))

        outcomes = self.ops.each_host(one, self.hosts)
        failed = {h: o.reason for h, o in outcomes.items() if not o.ok}
        if failed:
            raise HostFailure("starting every copy again (copying the chief's backup to every worker)", failed)

    def remove_worker_outputs(self) -> None:
        def one(hp: HostPlan) -> None:
            with self.ops.runner(hp) as t:
                dirs = [out_dir(hp, task) for task in hp.tasks if task.job == "worker"]
                t.run(["rm", "-rf", "--", *dirs], timeout=60)

        self.ops.each_host(one, self.hosts)

    def diagnose(self, pending: list[TaskPlan]) -> tuple[str, bool]:
        """Why the pending tasks never joined: is each one's port open on its host, and which
        hosts cannot reach it; and whether some host could not reach one."""
        serving = {s.task.name: bool(s.status and s.status.serving) for s in status.states(self.ops)}
        targets = {t.address: t for t in pending}
        unreachable: dict[str, list[str]] = {}

        def one(hp: HostPlan) -> ReachReply:
            others = [a for a, t in targets.items() if t.host != hp.name]
            with self.ops.runner(hp) as t:
                return launcher.ask(t, hp, ReachReply, hp.reach_argv(others, REACH_TIMEOUT),
                                    "checking the workers' ports", REACH_TIMEOUT + 30)

        for host, o in self.ops.each_host(one, self.hosts).items():
            if o.ok:
                for address in o.value.unreachable:
                    unreachable.setdefault(targets[address].name, []).append(host)
        return never_joined(self.plan, pending, serving, unreachable), bool(unreachable)

    def watch(self, interrupted: threading.Event) -> Attempt:
        """Follow every copy until all have ended (dtf.collective.watch)."""
        return Watch(self, interrupted).watch()


def run_collective(record: Record, program: str, args: list[str], output: str | None, attempts: int = 1,
                   join_timeout: float = JOIN_TIMEOUT, grace: float = STOP_GRACE,
                   connect_timeout: float = CONNECT_TIMEOUT,
                   taken_down: Callable[[], bool] = lambda: False, verbose: bool = False) -> int:
    """Run PROGRAM as one copy per worker task on the hosts; the chief's exit code. Unless
    `verbose`, TensorFlow's C++ chatter is left out of the copies' output (dtf.program.noise)."""
    out = Path(output or "dtf-output").resolve()
    run = CollectiveRun(record, Path(program).resolve(), args, out, join_timeout=join_timeout, grace=grace,
                        connect_timeout=connect_timeout, taken_down=taken_down, verbose=verbose)
    for note in check_plan(record.plan):
        say(note)
    if record.plan.ssh_config:  # the copies' followers and output copies read it (OpenSSH; paramiko without ssh)
        from dtf.hosts.connections import check_ssh_config

        check_ssh_config(record.plan.ssh_config_position(record.inventory), record.plan.ssh_config)
    with contextlib.ExitStack() as stack:
        keeper = stack.enter_context(LeaseKeeper(record.plan, warn=lambda m: say(f"warning: {m}"),
                                                 connect_timeout=connect_timeout))
        run.figures = stack.enter_context(RunFigures(record.plan.cluster, attempts, mode="collective"))
        interrupted = threading.Event()  # Ctrl-C and SIGTERM set it: dtf then stops the copies
        stack.enter_context(ctrl_c_sets(interrupted, signals=(signal.SIGINT, signal.SIGTERM)))
        t0 = time.monotonic()
        run.ship()
        failed = run.stop("the worker servers give their ports to the program")
        if failed:
            raise HostFailure("stopping the worker servers", failed)
        result = Attempt()
        again = False
        cannot_restart: HostFailure | None = None
        try:
            attempt = 1
            while True:
                run.figures.update(attempt=attempt)
                run.start_copies(attempt)
                say(f"started {len(run.workers)} copies of {Path(program).name} (attempt {attempt} of "
                    f"{attempts}), {time.monotonic() - t0:.1f}s after the command")
                try:
                    result = run.watch(interrupted)
                finally:
                    with tempfile.TemporaryDirectory(prefix="dtf-chief-") as tmp:
                        try:
                            count = run.fetch_chief(Path(tmp))
                            shutil.copytree(tmp, out, dirs_exist_ok=True)
                            say(f"the chief's output ({count} files) is in {out}")
                        except HostError as e:
                            say(f"the chief's output could not be brought back: {e}")
                            count = 0
                        again = (result.failure is not None and result.failure.lost and attempt < attempts
                                 and not result.interrupted and not result.taken_down)
                        if again and result.failure is not None and run.plan.spares:  # on a spare
                            moved = answered_or_moved(run.record, [result.failure.host], connect_timeout, say)
                            if moved.plan != run.plan:
                                run = run.on(moved)
                                keeper.follow(moved.plan)
                        if again:
                            try:
                                run.copy_backup(Path(tmp))
                            except HostFailure as e:  # a host still lost: no attempt can join
                                again, cannot_restart = False, e
                if result.failure is not None:
                    say(result.failure.describe())
                    run.figures.update(last_retry=result.failure.describe().splitlines()[0][:300])
                if cannot_restart is not None:
                    raise cannot_restart
                if not again:
                    break
                attempt += 1
                say(f"starting every copy again (attempt {attempt} of {attempts}): they resume from "
                    f"the last BackupAndRestore backup")
        finally:
            if not result.taken_down and not taken_down():
                if run.stop("end"):
                    say("some copies could not be stopped: `dtf down` retries")
                run.remove_worker_outputs()
                run.restore_servers()
    if result.interrupted:
        say("interrupted: every copy was stopped")
        return 130
    if result.failure is not None and not result.chief_code:
        return 1
    return result.chief_code if result.chief_code is not None else 1
