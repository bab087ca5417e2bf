"""`dtf train`: run the user's program here, as the chief (coordinator) of a recorded cluster."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf.cluster import state
from dtf.cluster.plan import GRPC_KEEPALIVE, Plan
from dtf.cluster.state import Record
from dtf.errors import ClusterDown, DtfError, HostFailure, UsageError
from dtf.hostops import reach, realloc
from dtf.hostops.lease import LeaseKeeper
from dtf.hostops.parallel import HostOps
from dtf.hostops.repair import Repair
from dtf.hostops.status import TaskState, states
from dtf.hosts.netutil import CONNECT_TIMEOUT, listen_port
from dtf.program import figures, noise
from dtf.program.runner import ERROR_FILE_ENV
from dtf.providers import route
from dtf.providers.choose import provider_for
from dtf_server.protocol import EXIT_STATUS_ENV, ended_before_crash, exit_reason

if TYPE_CHECKING:
    from dtf.hosts.tunnel import Tunnel

# After Ctrl-C: seconds until the program's main thread is sent SIGINT itself, until SIGTERM,
# and until SIGKILL.
INTERRUPT_STEPS = (3.0, 10.0, 15.0)
TGKILL = {"x86_64": 234, "aarch64": 131}  # syscall numbers (Linux)
DOWN_POLL = 0.5  # how often a running `dtf train` looks whether `dtf down` began
# Seconds `dtf train` waits for the cluster to answer this machine again once none of its tasks do
# (`--network-wait`): a dropped Wi-Fi, a VPN reconnecting, a laptop that slept.
NETWORK_WAIT = 600.0
REROUTE_EVERY = 5.0  # seconds between two looks, while no task answers directly, at whether SSH reaches them
DOWN_KILL_AFTER = 5.0  # seconds a program gets after TERM when its cluster is taken down


def interrupt_main_thread(pid: int) -> bool:
    """Send SIGINT to the main thread of process `pid` (its thread id is its pid).

    A terminal's Ctrl-C goes to the process, and the kernel hands it to any thread that does not
    block it: in a TensorFlow program, one of a hundred runtime threads. CPython then only sets a
    flag; the main thread, blocked in a C call (a sleep, a coordinator wait), never wakes to raise
    KeyboardInterrupt (https://docs.python.org/3/library/signal.html#execution-of-python-signal-handlers).
    Aimed at the main thread, the signal interrupts that call. Linux only; False elsewhere.
    """
    number = TGKILL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.syscall(number, pid, pid, int(signal.SIGINT)) == 0)


def dead_tasks(ops: HostOps, network: str, timeout: float = reach.PROBE_TIMEOUT) -> list[str]:
    """Tasks whose port does not accept a connection from here, as the cluster's network goes
    (directly, or through SSH), probed in parallel."""
    return [f"{t.name} ({t.host}, {t.address})" for t in reach.unreachable(ops, network, timeout)]


def tf_config(plan: Plan, chief_address: str) -> dict[str, Any]:
    """TF_CONFIG for the coordinator: the cluster of the plan, with this program as chief."""
    return {"cluster": {**plan.cluster_spec(), "chief": [chief_address]},
            "task": {"type": "chief", "index": 0}}


def program_env(plan: Plan, chief_host: str, output: str | None, attempt: int = 1,
                tunnel: Tunnel | None = None, synced: dict[str, str] | None = None,
                hook_env: dict[str, str] | None = None) -> dict[str, str]:
    """The program's environment; `synced`: name -> path on the workers, for dtf.synced();
    `hook_env`: the settings of dtf.program.hooks features (--wrap, --no-packing), applied last."""
    env = dict(os.environ)
    if tunnel is None:
        chief = f"{chief_host}:{listen_port()}"
    else:  # ssh mode: gRPC to the tasks goes through the tunnel's proxy; the tasks reach the chief back through it
        local = [t.addr_host for hp in plan.hosts if hp not in plan.remote_hosts for t in hp.tasks]
        env.update(tunnel.env(direct=[chief_host, *local]))
        chief = tunnel.chief_address
    env["TF_CONFIG"] = json.dumps(tf_config(plan, chief))
    env["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf-keras: Keras 3 has no PS (keras-team/keras#18624)
    env["GRPC_FAIL_FAST"] = "use_caller"
    env.setdefault("TF_GRPC_DEFAULT_OPTIONS", GRPC_KEEPALIVE)  # the user's own gRPC options win
    env["DTF_CLUSTER"] = plan.cluster
    env["DTF_ATTEMPT"] = str(attempt)
    env["DTF_SYNCED"] = json.dumps(synced or {})
    if output:
        env["DTF_OUTPUT_DIR"] = str(Path(output).resolve())
    # dtf.program.hooks: the guard rails warn about what calls the coordinator back in ssh mode.
    env["DTF_NETWORK"] = "direct" if tunnel is None else "ssh"
    if env.get(figures.ENV) != "off":  # off: nothing published (bench/top.py's baseline)
        env[figures.ENV] = str(figures.live_dir(state.home(), plan.cluster))  # for `dtf top`
    env.update(hook_env or {})
    return env


def say(message: str) -> None:
    print(f"dtf: {message}", file=sys.stderr, flush=True)


def run_program(record: Record, program: str, args: list[str], output: str | None,
                attempts: int = 3, ps_wait: float = 120.0,
                connect_timeout: float = CONNECT_TIMEOUT, verbose: bool = False,
                hook_env: dict[str, str] | None = None, allocation_wait: float = realloc.ALLOCATION_WAIT,
                report: Callable[[figures.Shares], None] | None = None, network_wait: float = NETWORK_WAIT) -> int:
    """Run `python PROGRAM ARGS` as the cluster's chief; return its exit code.

    While it runs, the cluster's lease is renewed. If the program fails because a ps was lost
    (its server died and its supervisor restarted it, or it cannot be reached), dtf waits up to
    `ps_wait` seconds for every task to serve again and runs the program again, up to `attempts`
    runs in all: the program resumes from its last checkpoint (a lost ps loses its variables).
    A failure with every ps intact is the program's own: its exit code is returned at once; but
    one where the program lost its connection to the cluster (no task answered this machine, or it
    died of TensorFlow's connection error with the cluster intact: this machine's network dropped,
    or it slept) runs it again too, once every task answers this machine (waited for up to
    `network_wait` seconds).
    Meanwhile a `Repair` starts again each task whose supervisor is gone, and moves the
    tasks of a host unanswered past `host_timeout` to a spare: the program is then stopped and
    runs again on the new placement (ClusterDown, in one line, where no spare is left).
    A Slurm job that ended meanwhile (a lost node, a preemption, the time limit) is replaced by a
    new allocation from the same inventory, pending up to `allocation_wait` seconds (dtf.hostops.realloc),
    and the program runs again there; a job of the user's own (`job:`) ends the run in one line.
    Unless `verbose`, TensorFlow's own chatter is filtered out of the program's stderr (dtf.program.noise).
    Once the program has succeeded (exit code 0), `report` gets what each worker did in the run, as
    the program's coordinator counted it (dtf.program.figures.Shares); a run that failed ends with
    its error instead.
    """
    shares = figures.Shares()
    code = _attempts(record, program, args, output, attempts, ps_wait, connect_timeout, verbose, hook_env,
                     allocation_wait, shares, network_wait)
    if report is not None and code == 0:
        report(shares)
    return code


def _attempts(record: Record, program: str, args: list[str], output: str | None, attempts: int, ps_wait: float,
              connect_timeout: float, verbose: bool, hook_env: dict[str, str] | None, allocation_wait: float,
              shares: figures.Shares, network_wait: float = NETWORK_WAIT) -> int:
    """run_program's attempts; each one's figures added to `shares`."""
    return Attempts(record, program, args, output, attempts=attempts, ps_wait=ps_wait, network_wait=network_wait,
                    allocation_wait=allocation_wait, connect_timeout=connect_timeout, verbose=verbose,
                    hook_env=hook_env, shares=shares).run()


class Attempts:
    """The program's attempts on the cluster, and what keeps the cluster while they run (the lease,
    the repair, the route to the tasks: `hold`). After an attempt that failed, `after` decides what
    comes next: the program's own failure ends the run with its exit code; a ps lost, tasks moved
    to a spare, the connection between this machine and the cluster lost, or the allocation ended
    (replaced by a new one) make the next attempt, which resumes from the last checkpoint."""

    def __init__(self, record: Record, program: str, args: list[str], output: str | None, *, attempts: int,
                 ps_wait: float, network_wait: float, allocation_wait: float, connect_timeout: float,
                 verbose: bool, hook_env: dict[str, str] | None, shares: figures.Shares) -> None:
        self.record, self.program, self.args, self.output = record, program, args, output
        self.attempts, self.ps_wait, self.network_wait = attempts, ps_wait, network_wait
        self.allocation_wait, self.connect_timeout = allocation_wait, connect_timeout
        self.verbose, self.hook_env, self.shares = verbose, hook_env, shares
        self.attempt = 1
        self.ops = serving(record, connect_timeout)

    @property
    def cluster(self) -> str:
        return self.record.cluster

    def run(self) -> int:
        with contextlib.ExitStack() as stack:
            self.figures = stack.enter_context(RunFigures(self.cluster, self.attempts, shares=self.shares))
            self.held = stack.enter_context(contextlib.ExitStack())  # what one allocation's run keeps: hold()
            self.tunnels = stack.enter_context(contextlib.ExitStack())  # opened again when tasks move
            self.tunnel, self.repair = hold(self.held, self.tunnels, self.record, self.connect_timeout)
            while True:
                allocation = self.record.plan.allocation
                self.figures.update(attempt=self.attempt, job=allocation.job if allocation else None)
                before = ps_incarnations(self.ops)
                changes = self.repair.changes
                code, interrupted, error = run_once(self.record, self.program, self.args, self.output, self.attempt,
                                                    self.tunnel, self.verbose, self.hook_env,
                                                    stop_if=functools.partial(self.repair.stop_reason, changes))
                self.figures.collect(self.record.plan)
                if code == 0 or interrupted:
                    return code
                if not self.after(code, before, error):
                    if error is not None:  # the program's own: its traceback, as Python would have printed it
                        print(error.traceback, end="", file=sys.stderr, flush=True)
                    return code

    def after(self, code: int, before: dict[str, tuple[int, int | None]], error: ProgramError | None) -> bool:
        """After attempt `self.attempt` failed with `code`: whether the program runs again (the
        next attempt set up), or not (its own failure, or no attempt left: said in one line).
        ClusterDown where the cluster cannot go on."""
        # A job that ended took its tasks with it: no task answers, and that is not the network's.
        # Its login host unanswered too: the network's, waited for; then asked again.
        try:
            ended, asked = job_ended(self.record, self.connect_timeout), True
        except HostFailure:
            ended, asked = None, False
        cut = self.wait_for_contact() if ended is None else None  # before anything is asked of the hosts
        plan, repair = self.record.plan, self.repair
        if not asked or cut is not None:  # the job may have ended while this machine was cut off
            ended = job_ended(self.record, self.connect_timeout)
        if ended is not None:  # the allocation's end: a new one, where dtf made it
            return self.reallocate(ended)
        if repair.lost is not None:
            raise ClusterDown(repair.lost)
        moved = [f"{t.name} (moved to {t.host})" for t in repair.plan.tasks()
                 if (was := plan.task(t.name)) is not None and was.host != t.host]
        # The ps as placed now: a host lost for good is not asked again (it would not answer).
        now = self.ops if not moved else HostOps(repair.plan, connect_timeout=self.connect_timeout)
        lost = moved + [x for x in lost_ps(now, before, self.record.network)
                        if x.split(" ")[0] not in {m.split(" ")[0] for m in moved}]
        if lost:
            what = f"{', '.join(lost)} lost during attempt {self.attempt}"
        elif cut is not None or error is not None:
            # The cluster is intact: the program lost its connection to it (this machine's network).
            why = f"no task answered this machine for {cut:.0f}s" if cut is not None else error.error  # type: ignore[union-attr]
            what = f"the program lost its connection to cluster {self.cluster!r} during attempt {self.attempt} ({why})"
        else:
            return False
        if self.attempt >= self.attempts:
            say(f"{what}; no attempts left (--attempts {self.attempts})")
            return False
        if not lost:
            say(f"{what}; the cluster is intact")
            self.figures.update(last_retry=what)
            return self.again()
        say(f"{what} of {self.attempts}; waiting up to {self.ps_wait:g}s for every task to serve again")
        self.figures.update(last_retry=what, waiting=True)
        t0 = time.monotonic()
        watch = realloc.JobWatch(self.record, self.connect_timeout, job_ended)  # the allocation may end meanwhile
        still = repair.wait_serving(self.ps_wait, stop=watch)
        if watch.ended is not None:
            return self.reallocate(watch.ended)
        if repair.lost is not None:
            raise ClusterDown(repair.lost)
        if still:
            raise ClusterDown(f"cluster {plan.cluster!r}: still not serving after {self.ps_wait:g}s: "
                              f"{', '.join(still)} (see `dtf status`, `dtf logs TASK`)")
        return self.again(f"cluster serving again after {time.monotonic() - t0:.1f}s; ")

    def allocation_ended(self) -> str | None:
        """`job_ended`, where the hosts' allocation can end and its login host answers; None where
        it runs, and where the login host does not answer either (the network, waited for)."""
        if not provider_for(self.record.plan, self.connect_timeout).ends:
            return None
        try:
            return job_ended(self.record, self.connect_timeout)
        except HostFailure:
            return None

    def wait_for_contact(self) -> float | None:
        """Where no task answers this machine (its network dropped, or it woke from a sleep with its
        connections gone), wait until every task does again, up to `network_wait` seconds: how long
        that took (None: they answered at once). A cluster that answers again through SSH only (a
        new address, refused by the hosts' firewall) is reached so from then on (`reroute`).
        ClusterDown past the wait."""
        plan = self.repair.plan
        ops = HostOps(plan, connect_timeout=self.connect_timeout)
        if len(reach.unreachable(ops, self.record.network, reach.PROBE_TIMEOUT)) < len(plan.tasks()):
            return None
        t0 = time.monotonic()
        if self.reroute(ops):
            return 0.0
        say(f"no task of cluster {self.cluster!r} answers this machine (its network?): waiting up to "
            f"{self.network_wait:g}s for them (--network-wait)")
        self.figures.update(network_lost_since=time.strftime("%H:%M:%S"))
        deadline = t0 + self.network_wait
        rerouted_at = asked_at = time.monotonic()
        while True:
            if self.repair.lost is not None:
                raise ClusterDown(self.repair.lost)
            if time.monotonic() - asked_at >= REROUTE_EVERY:
                asked_at = time.monotonic()
                if self.allocation_ended() is not None:  # the job's end, not the network: after() says so
                    self.figures.update(network_lost_since=None)
                    return time.monotonic() - t0
            ops = HostOps(self.repair.plan, connect_timeout=self.connect_timeout)
            still = reach.unreachable(ops, self.record.network, reach.PROBE_TIMEOUT)
            if not still:
                break
            if len(still) == len(ops.plan.tasks()) and time.monotonic() - rerouted_at >= REROUTE_EVERY:
                rerouted_at = time.monotonic()
                if self.reroute(ops):
                    break
            if time.monotonic() >= deadline:
                raise ClusterDown(
                    f"cluster {self.cluster!r}: no task answered this machine for {self.network_wait:g}s "
                    f"(--network-wait): {', '.join(f'{t.name} ({t.host}, {t.address})' for t in still)}; the "
                    f"cluster runs on until its lease lapses, and `dtf train` again resumes from the last checkpoint")
            time.sleep(1.0)
        waited = time.monotonic() - t0
        self.figures.update(network_lost_since=None)
        say(f"cluster {self.cluster!r} answers again after {waited:.0f}s")
        return waited

    def reroute(self, ops: HostOps) -> bool:
        """Where this machine reaches the tasks directly (network: direct, as `up` decided), and no
        longer does, but SSH to their hosts reaches them (a new address: another Wi-Fi, refused by
        the hosts' firewall, which lets in the address this machine had at `dtf up`): from now on,
        through SSH (True), where the inventory leaves the network to dtf (auto); ClusterDown where
        it says direct."""
        if route.rides_ssh(self.record.network) or reach.unreachable(ops, "ssh", reach.PROBE_TIMEOUT):
            return False
        if route.direct_only(self.record.plan):
            raise ClusterDown(f"cluster {self.cluster!r}: its tasks serve, but this machine no longer reaches their "
                              f"ports directly (a new address? the hosts' firewall lets in the one it had at `dtf "
                              f"up`), and the inventory says network: direct: set network: auto (then dtf goes "
                              f"through SSH) or ssh, and `dtf up --replace INVENTORY`")
        self.record = self.record.replace(network="ssh")
        self.repair.record = self.repair.record.replace(network="ssh")
        with state.locked(wait=30), contextlib.suppress(DtfError):
            now = state.load(self.cluster)
            if not now.taking_down and now.created == self.record.created:
                state.save(now.replace(network="ssh"))
        self.tunnels.close()
        self.tunnel = tunnel_to(self.tunnels, self.record, self.connect_timeout)
        say(f"cluster {self.cluster!r} answers this machine through SSH only now (a new address, or a firewall "
            f"on the way): the training's connections go through SSH from now on")
        return True

    def again(self, said: str = "") -> bool:
        """The next attempt, on the cluster as the repair has it now (tasks moved: new addresses)."""
        repair = self.repair
        if repair.record.plan != self.record.plan:  # tasks moved: the next attempt's addresses
            self.record = repair.record
            self.ops = HostOps(self.record.plan, connect_timeout=self.connect_timeout)
            self.tunnels.close()
            self.tunnel = tunnel_to(self.tunnels, self.record, self.connect_timeout)
        self.attempt += 1
        self.figures.update(waiting=False)
        say(f"{said}running the program again (attempt {self.attempt} of {self.attempts}): it resumes from its "
            f"last checkpoint")
        return True

    def reallocate(self, ended: str) -> bool:
        """The allocation ended (`ended`: why): a new one, and the next attempt on it."""
        refused = realloc.refusal(self.record, ended, self.attempt, self.attempts)
        if refused is not None:
            raise ClusterDown(refused)
        self.figures.update(last_retry=f"{ended} (attempt {self.attempt})", reallocating=True)
        self.tunnels.close()
        self.held.close()
        self.record = realloc.comeback(self.record, ended, wait=self.allocation_wait,
                                       connect_timeout=self.connect_timeout, say=say)
        self.ops = HostOps(self.record.plan, connect_timeout=self.connect_timeout)
        self.tunnel, self.repair = hold(self.held, self.tunnels, self.record, self.connect_timeout)
        self.attempt += 1
        self.figures.update(reallocating=False)
        say(f"running the program again (attempt {self.attempt} of {self.attempts}): it resumes from its last "
            f"checkpoint")
        return True


def serving(record: Record, connect_timeout: float) -> HostOps:
    """What a coordinator needs before it starts (`dtf train`, `dtf.connect()`): a ps, the Slurm job
    still running, every task serving. The cluster's HostOps; ClusterDown or UsageError if not."""
    plan = record.plan
    if not any(t.job == "ps" for t in plan.tasks()):
        raise UsageError(f"cluster {plan.cluster!r} has no ps task: ParameterServerStrategy needs one "
                         f"(`dtf train --collective` runs without)")
    ops = HostOps(plan, connect_timeout=connect_timeout)
    job_ended(record, connect_timeout, raise_it=True)
    dead = dead_tasks(ops, record.network)
    if dead:
        raise ClusterDown(f"cluster {plan.cluster!r}: not serving: {', '.join(dead)} "
                          f"(see `dtf status`, `dtf logs TASK`)")
    return ops


def attach(stack: contextlib.ExitStack, record: Record, connect_timeout: float) -> Tunnel | None:
    """What keeps a coordinator attached, for as long as `stack` is open: the lease renewed (by a
    daemon thread: it ends with the process) and, in ssh mode, the tunnel (returned; None else)."""
    keep_lease(stack, record, connect_timeout)
    return tunnel_to(stack, record, connect_timeout)


def hold(held: contextlib.ExitStack, tunnels: contextlib.ExitStack, record: Record,
         connect_timeout: float) -> tuple[Tunnel | None, Repair]:
    """What `dtf train` keeps while it runs on one allocation of the cluster `record` holds: what
    attach() keeps, and the repair (dead tasks started again, a lost host's tasks moved to a
    spare: dtf.hostops.repair). The lease and the repair in `held`; the tunnel in `tunnels`
    (opened again when tasks move)."""
    keeper = keep_lease(held, record, connect_timeout)
    repair = held.enter_context(Repair(record, connect_timeout, say, on_plan=keeper.follow))
    return tunnel_to(tunnels, record, connect_timeout), repair


def keep_lease(stack: contextlib.ExitStack, record: Record, connect_timeout: float) -> LeaseKeeper:
    """The cluster's lease renewed for as long as `stack` is open."""
    return stack.enter_context(LeaseKeeper(record.plan, warn=lambda m: say(f"warning: {m}"),
                                           connect_timeout=connect_timeout, spares=record.coordinator is not None))


def tunnel_to(stack: contextlib.ExitStack, record: Record, connect_timeout: float) -> Tunnel | None:
    """In ssh mode, the tunnel to the tasks, open for as long as `stack` is (None in direct mode)."""
    tunnel = provider_for(record.plan, connect_timeout).route(record.network)
    return stack.enter_context(tunnel) if tunnel is not None else None


def program_argv(program: str, args: list[str]) -> list[str]:
    """The command that runs the program: a script through dtf.program.runner, a notebook (.ipynb)
    through dtf.notebook.execute (in a Jupyter kernel)."""
    from dtf.program.runner import python_m

    if program.endswith(".ipynb"):
        return python_m("dtf.notebook.execute", program, *args)
    return python_m("dtf.program.runner", program, *args)


class NoFigures:
    """Figures nobody publishes (a collective run made outside `run_collective`, in tests)."""

    def update(self, **changes: Any) -> None:
        pass


class RunFigures:
    """`dtf train`'s own figures for `dtf top` (dtf.program.figures' run.json): the attempt and
    the last retry. Written when they change; removed, with the program's, when the run ends."""

    def __init__(self, cluster: str, attempts: int, mode: str = "ps", shares: figures.Shares | None = None) -> None:
        self.dir = figures.live_dir(state.home(), cluster)
        self.shares = figures.Shares() if shares is None else shares  # what each worker did: see collect
        self.data: dict[str, Any] = {"schema": figures.SCHEMA, "kind": mode, "pid": os.getpid(),
                                     "started": time.time(), "attempt": 1, "attempts": attempts,
                                     "last_retry": None, "waiting": False}

    def update(self, **changes: Any) -> None:
        self.data.update(changes, time=time.time())
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            figures.write_atomic(self.dir / figures.RUN, self.data)
        except OSError:
            pass  # the view is a convenience

    def collect(self, plan: Plan) -> None:
        """Once an attempt's program has ended: its last figures (its train.json, written at its
        exit) added to `shares`, and removed (the next attempt's program writes its own)."""
        path = self.dir / figures.TRAIN
        self.shares.add(figures.read(path), {t.index: t.host for t in plan.tasks() if t.job == "worker"})
        with contextlib.suppress(OSError):
            path.unlink()

    def __enter__(self) -> RunFigures:
        (self.dir / figures.TRAIN).unlink(missing_ok=True)  # a previous run's
        self.update()
        return self

    def __exit__(self, *exc: object) -> None:
        for path in [self.dir / figures.RUN, self.dir / figures.TRAIN, *figures.leftovers(self.dir)]:
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def job_ended(record: Record, connect_timeout: float, raise_it: bool = False) -> str | None:
    """On a Slurm cluster whose job no longer runs (its time limit, a preemption, a lost node):
    one line on why, with Slurm's reason (ClusterDown with it, `raise_it`); else None."""
    ended = provider_for(record.plan, connect_timeout).ended("dtf train")
    if ended is not None and raise_it:
        raise ClusterDown(f"cluster {record.plan.cluster!r}: {ended}")
    return ended


def ps_states(ops: HostOps) -> list[TaskState]:
    """Each ps task's state as its host reports it."""
    return [s for s in states(ops) if s.task.job == "ps"]


def ps_incarnations(ops: HostOps) -> dict[str, tuple[int, int | None]]:
    return {s.task.name: s.status.incarnation for s in ps_states(ops) if s.status is not None}


def lost_ps(ops: HostOps, before: dict[str, tuple[int, int | None]], network: str = "direct") -> list[str]:
    """The ps tasks lost since `before`: restarted or not serving on their host, or not
    reachable from here. Names with the reason, e.g. "ps:0 (server killed by SIGKILL)"."""
    lost = {}
    for s in ps_states(ops):
        name = s.task.name
        if s.status is None:  # its host cannot be asked: is it reachable from here?
            continue
        if name in before and s.status.incarnation != before[name]:
            lost[name] = f"server {s.status.last_exit or 'restarted'}"
        elif not s.status.serving:
            lost[name] = "not serving"
    rest = [t.name for t in ops.plan.tasks() if t.job == "ps" and t.name not in lost]
    if rest:
        for t in reach.unreachable(ops, network, reach.PROBE_TIMEOUT, rest):
            lost[t.name] = f"{t.address} unreachable"
    return [f"{name} ({why})" for name, why in sorted(lost.items())]


def wait_serving(ops: HostOps, network: str, timeout: float) -> list[str]:
    """Wait until every task accepts connections from here; the ones that still do not."""
    deadline = time.monotonic() + timeout
    while True:
        dead = dead_tasks(ops, network, timeout=min(reach.PROBE_TIMEOUT, max(0.1, deadline - time.monotonic())))
        if not dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.25)


def taken_down(record: Record) -> bool:
    """`dtf down` has begun on the cluster, or it is gone from the record (or another `dtf up`
    replaced it)."""
    try:
        now = state.load(record.cluster)
    except DtfError:
        return True
    return now.taking_down or now.created != record.created


@dataclass(frozen=True)
class ProgramError:
    """What the program raised that says a connection to the cluster failed (dtf.program.runner's
    connection_error), kept for `dtf train` to print where the failure turns out the program's own."""

    error: str  # its type and first line
    traceback: str


def run_once(record: Record, program: str, args: list[str], output: str | None,
             attempt: int, tunnel: Tunnel | None = None, verbose: bool = False,
             hook_env: dict[str, str] | None = None,
             stop_if: Callable[[], str | None] = lambda: None) -> tuple[int, bool, ProgramError | None]:
    """One run of the program: (exit code, stopped on purpose: Ctrl-C, or `dtf down`, the error
    that says its connection to the cluster failed: ProgramError, not printed).

    Ctrl-C reaches the program (it is in our terminal's process group) and stops it; dtf waits
    for it and leaves the cluster up. SIGTERM sent to dtf alone is passed on to the program.
    `dtf down` on the cluster stops it too (its workers are going away: it would wait for them),
    and so does `stop_if` saying why (tasks moved to a spare: not a stop on purpose).
    """
    plan = record.plan
    env = program_env(plan, record.chief_host, output, attempt, tunnel,
                      synced={name: s.task_path for name, s in record.synced.items()}, hook_env=hook_env)
    interrupted_at: float | None = None
    proc: subprocess.Popen[bytes] | None = None
    down = False

    def watch_down() -> bool:
        nonlocal down
        if taken_down(record):
            down = True
            say(f"cluster {plan.cluster!r} is being taken down (`dtf down`): stopping the program")
            return True
        why = stop_if()
        if why is not None:
            say(why)
        return why is not None

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupted_at
        if interrupted_at is None:
            interrupted_at = time.monotonic()  # the terminal sent it to the program too

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal interrupted_at
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if interrupted_at is None:
            interrupted_at = time.monotonic()  # stopped on purpose: never run it again

    # Handlers (not SIG_IGN): a handler resets to the default in the child, so the program still
    # gets its KeyboardInterrupt.
    old_int = signal.signal(signal.SIGINT, on_sigint)
    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    stderr_pump = None
    status = tempfile.NamedTemporaryFile(prefix="dtf-exit-", delete=False)
    status.close()
    env[EXIT_STATUS_ENV] = status.name
    error_file = status.name + ".error"
    env[ERROR_FILE_ENV] = error_file
    try:
        proc = subprocess.Popen(program_argv(program, args), env=env,
                                stderr=None if verbose else subprocess.PIPE)
        if proc.stderr is not None:
            stderr_pump = noise.pump(proc.stderr, sys.stderr.buffer)
        code = _wait(proc, lambda: interrupted_at, watch_down)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        if stderr_pump is not None:
            # The pipe ends with the program, unless a child of it still holds it: do not wait on that.
            stderr_pump.join(timeout=5)
        ended = proc.returncode if proc is not None else None
        finished = ended_before_crash(ended, status.name) if ended is not None else None
        os.unlink(status.name)
        error = _read_error(error_file)
    if finished is not None and interrupted_at is None and not down:
        say(f"the program ended with exit code {finished}, then was {exit_reason(code)} while Python "
            f"shut down (TensorFlow's runtime, after the program's work was done): exit code {finished} stands")
        code = finished
    if interrupted_at is not None and not down:
        if record.coordinator is not None:  # a detached run, stopped (`dtf down --stop-run`, its job's end)
            say(f"the program was stopped on {record.coordinator}")
        else:
            say(f"program interrupted; cluster {plan.cluster!r} is still up (`dtf down` stops it)")
    stopped = interrupted_at is not None or down
    if error is not None and stopped:  # stopped on purpose: its error is said as Python would
        print(error.traceback, end="", file=sys.stderr, flush=True)
        error = None
    return (128 - code if code < 0 else code), stopped, error


def _read_error(path: str) -> ProgramError | None:
    """The connection error the program's runner wrote to `path` (then removed); None if none."""
    try:
        with open(path) as f:
            data = json.load(f)
        return ProgramError(str(data["error"]), str(data["traceback"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _wait(proc: subprocess.Popen[bytes], interrupted_at: Callable[[], float | None],
          taken_down: Callable[[], bool]) -> int:
    """Wait for the program; after a Ctrl-C, make sure it stops within INTERRUPT_STEPS[-1] s.
    When `taken_down()` (asked every DOWN_POLL s) says the cluster is going, TERM the program,
    and KILL it DOWN_KILL_AFTER s later."""
    done = 0  # how many escalation steps were taken
    checked = time.monotonic()
    down_at: float | None = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if down_at is None and now - checked >= DOWN_POLL:
            checked = now
            if taken_down():
                down_at = now
                proc.send_signal(signal.SIGTERM)
        elif down_at is not None and now - down_at >= DOWN_KILL_AFTER:
            proc.kill()
            down_at = float("inf")  # once: the next wait() reaps it
        since = interrupted_at()
        if since is None or done >= len(INTERRUPT_STEPS):
            continue
        if time.monotonic() - since < INTERRUPT_STEPS[done]:
            continue
        if done == 0:
            interrupt_main_thread(proc.pid)
        else:
            sig = signal.SIGTERM if done == 1 else signal.SIGKILL
            print(f"dtf: the program is still running {INTERRUPT_STEPS[done]:g}s after Ctrl-C: "
                  f"sending {sig.name}", file=sys.stderr)
            proc.send_signal(sig)
        done += 1
