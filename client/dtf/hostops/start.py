"""Starting the servers of a plan on its hosts (`dtf up`, a repair, collective mode's restore): ship
the launcher, check the host's python and TensorFlow (or build its managed environment), start
the servers (their start closes the TF ports to non-members first: dtf_server.firewall), and check
this machine reaches them."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dtf.cluster.plan import HostPlan, TaskPlan
from dtf.files import environment, shipping
from dtf.hostops.environments import Environments, EnvReport
from dtf.hostops.launcher import decode
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hostops.reach import MESH_TIMEOUT, others
from dtf.hosts.base import CommandRunner, Conversation, HostError, Result, ServerStart
from dtf.providers import route
from dtf_server.protocol import CheckReply, FirewallReply, StartReply, tf_version

CHECK_TIMEOUT = 30.0  # seconds for the launcher's upload and its check (a python start and a look around)
# How often a host waiting for the others looks at Ctrl-C (the meeting's outcome wakes it at once:
# the last host's arrival, or a failure): seldom, as a hundred hosts may wait at the same time on
# the laptop.
GATE_POLL = 0.5


@functools.cache
def local_tf_version() -> str | None:
    """The laptop's TensorFlow version, asked the same way the launcher asks on each host (once
    per command: `up` and the repair each ask it)."""
    return tf_version()


def server_pids(started: StartReply) -> dict[str, int]:
    return {n: s.server_pid for n, s in started.tasks.items() if s.server_pid is not None}


@dataclass(frozen=True)
class HostStarted:
    pids: dict[str, int]  # task -> its supervisor's pid
    client_address: str | None  # the laptop's address as the host saw it
    direct: bool = True  # its tasks' TF ports accept connections from this machine directly
    env: EnvReport | None = None  # `python: managed`
    # It checked it reaches every other host's task, in its start (`Starter(mesh=True)`).
    reached: bool = False
    # The TF ports' firewall rules its start set, or why it could not (None: `firewall: off`).
    firewall: FirewallReply | None = None
    # task -> its server's pid: the pid `dtf up` and `dtf status` show (the process that serves)
    server_pids: dict[str, int] = field(default_factory=dict)


class Starter:
    """One start of a plan's tasks. It remembers what it did, for the rollback: the hosts it
    uploaded the launcher to (`touched`) and those it started tasks on (`started`)."""

    def __init__(self, ops: HostOps, mesh: bool = False) -> None:
        self.ops = ops
        # `mesh`: each host's start also checks it reaches the other hosts' tasks (the mesh
        # check, reach.check_mesh, in the same launcher call): where every host starts at once
        # (a host waits there for the others' servers), or where each is told when they all serve
        # (`_gate`: hosts taken in turns).
        self.mesh = mesh
        self.env = Environments(ops)
        self.touched: set[str] = set()  # hosts `up` uploaded the launcher to
        self.started: set[str] = set()  # hosts `up` started tasks on
        self._gate: _Gate | None = None

    def up(self, only: dict[str, set[str]] | None = None) -> dict[str, Outcome[HostStarted]]:
        """Start every task, or only the tasks named per host in `only`."""
        version = local_tf_version()
        hosts = self.ops.hosts_in(only) if only is not None else self.ops.plan.hosts
        at_once = self._decide(hosts)
        if only is None:
            return self.ops.each_host(lambda hp: self.start_host(hp, version), at_once=at_once)
        return self.ops.each_host(lambda hp: self.start_host(hp, version, only[hp.name]), hosts, at_once=at_once)

    def _decide(self, hosts: Sequence[HostPlan]) -> int | None:
        """How `hosts` start: the hosts taken at once (None: all), whether each start checks the
        mesh (`mesh`), and whether they are told when to (`_gate`)."""
        # Turns where no host waits for another (managed hosts copy their wheels from each other).
        at_once = None if any(hp.managed for hp in self.ops.plan.hosts) else self.ops.at_once()
        if self.mesh and at_once is not None and self._can_tell(hosts):
            # Each host's start ends its turn once its servers serve, and checks the mesh once
            # told that every host's do: one launcher call per host, whatever their number.
            rounds = -(-len(hosts) // at_once)
            longest = max(CHECK_TIMEOUT + hp.start_timeout + 30 + self.ops.connect_timeout for hp in hosts)
            self._gate = _Gate(len(hosts), at_once, rounds * longest + 60, self.ops.cancel)
            at_once = None
        self.mesh = self.mesh and (at_once is None or len(hosts) <= at_once)
        return at_once

    def _can_tell(self, hosts: Sequence[HostPlan]) -> bool:
        """Whether every host's start can be told when to check the mesh: one launcher call each
        (`_in_one_call`), whose stdin stays open (the provider says where: an OpenSSH master)."""
        return len(hosts) > 1 and self.ops.provider.converses(hosts) and all(self._in_one_call(hp) for hp in hosts)

    def start_host(self, hp: HostPlan, tf_version: str | None, only: Collection[str] | None = None
                   ) -> HostStarted:
        """Start the host's tasks (or those named in `only`: the others keep running): connect,
        prepare the host, start its servers, and verify this machine reaches them."""
        if self._gate is not None:
            return self._told_start(hp, tf_version, only, self._gate)
        self.ops.step(hp, "connecting")
        with self.ops.runner(hp) as t:
            env = None
            if self._in_one_call(hp):
                check, started = self._check_and_start(t, hp, tf_version, only)
            else:
                check = self._check(t, hp, tf_version, only)
                env = self.env.build(t, hp, check, hp.tasks_in(only)[0].port) if hp.managed else None
                started = self._start_servers(t, hp, only)
            self.ops.step(hp, "checking the servers are reachable from here")
            direct = self._reachable(t, hp, hp.tasks_in(only))
        return HostStarted(pids={n: s.pid for n, s in started.tasks.items() if s.pid is not None},
                           server_pids=server_pids(started),
                           client_address=check.client_address, direct=direct, env=env,
                           reached=started.unreachable == {}, firewall=started.firewall)

    def _told_start(self, hp: HostPlan, tf_version: str | None, only: Collection[str] | None,
                    gate: _Gate) -> HostStarted:
        """start_host where hosts start in turns and each is told when to check the mesh: the
        host's turn is its check-start up to its servers' reply; then (its turn over) this
        machine's reach, and once every host has got that far, "go" on the launcher's stdin and
        the mesh check's finding. A host that failed, or Ctrl-C, tells the others "stop"."""
        conv: Conversation | None = None
        arrived = False
        tasks = hp.tasks_in(only)
        targets, reach_timeout = self._reach(hp)
        try:
            with gate.slot:
                self.ops.step(hp, "connecting")
                t = self.ops.runner(hp)
                t.open()  # a host never reached is not touched: nothing to roll back there
                self._check_start_step(hp, tasks)
                argv = hp.check_start_argv(only, tf_version, targets, reach_timeout, told=2 * gate.wait + 30)
                self.touched.add(hp.name)
                conv = t.put_and_converse(shipping.launcher_bytes(), hp.root, shipping.launcher_name(), argv)
                deadline = time.monotonic() + CHECK_TIMEOUT + hp.start_timeout + 30
                check = self._checked(self._said(t, conv, deadline, "the check"), hp, tf_version, only)
                self.started.add(hp.name)  # it passed the check: it starts them
                started = self._started(self._said(t, conv, deadline, "starting servers"))
            gate.arrive(True)
            arrived = True
            self.ops.step(hp, "checking the servers are reachable from here")
            direct = self._reachable(t, hp, tasks)
            unreachable = None
            if targets:
                self.ops.step(hp, "waiting for the other hosts' servers")
                go = gate.all_serve()
                if not go:
                    conv.send("stop")
                else:  # in turns again: 100 hosts checking 99 targets each at once starve hosts that share cores
                    with gate.slot:
                        self.ops.step(hp, "checking it reaches the other hosts' tasks")
                        conv.send("go")
                        unreachable = self._started(self._said(t, conv, time.monotonic() + reach_timeout + 30,
                                                                  "checking the other hosts' TF ports")).unreachable
            conv.finish(5)
        finally:
            if not arrived:
                gate.arrive(False)
            if conv is not None:
                conv.kill()
        return HostStarted(pids={n: s.pid for n, s in started.tasks.items() if s.pid is not None},
                           server_pids=server_pids(started),
                           client_address=check.client_address, direct=direct, reached=unreachable == {},
                           firewall=started.firewall)

    def _check_start_step(self, hp: HostPlan, tasks: Sequence[TaskPlan]) -> None:
        """The host's step while its check-start runs (told or not)."""
        self.ops.step(hp, f"uploading launcher, checking python and TensorFlow, starting {len(tasks)} server(s)")

    @staticmethod
    def _said(t: CommandRunner, conv: Conversation, deadline: float, what: str) -> Result:
        """The launcher's next line that is not blank (a login script's empty line: as `t.run`'s
        output is read), as a Result; where it ended without one, its exit status and stderr
        (the master lost: HostError, as `t.run` says it). HostError past `deadline`."""
        while (line := conv.readline(max(0.0, deadline - time.monotonic()))) is not None:
            if line.strip():
                return Result(0, line, "")
        r = conv.finish(5)
        if r.exit_code < 0 and time.monotonic() >= deadline:
            raise HostError(f"{what} timed out")
        return t.result(r)

    def _in_one_call(self, hp: HostPlan) -> bool:
        """Whether the host's check and start are one launcher call: nothing happens between them
        (no environment to build; the firewall rules are the start's first step)."""
        return not hp.managed

    def _ship_and_run(self, t: CommandRunner, hp: HostPlan, argv: list[str], timeout: float) -> Result:
        """Upload the launcher and run one of its commands, in one round trip where the runner can."""
        self.touched.add(hp.name)  # from here on, a rollback must remove what we put there
        return t.put_then_run(shipping.launcher_bytes(), hp.root, shipping.launcher_name(), argv, timeout=timeout)

    def _check(self, t: CommandRunner, hp: HostPlan, tf_version: str | None, only: Collection[str] | None
               ) -> CheckReply:
        """Ship the launcher and check the host: its python and TensorFlow (a managed host's
        environment is checked by `Environments.build`, once the ports are known to be free),
        no other dtf's cluster of this name there, its planned ports free."""
        self.ops.step(hp, "uploading launcher, checking python and "
                      + ("its environment" if hp.managed else "TensorFlow"))
        return self._checked(self._ship_and_run(t, hp, hp.check_argv(only), CHECK_TIMEOUT), hp, tf_version, only)

    def _check_and_start(self, t: CommandRunner, hp: HostPlan, tf_version: str | None, only: Collection[str] | None
                         ) -> tuple[CheckReply, StartReply]:
        """`_check` and `_start_servers` in one launcher call (`check-start`: one python start and
        one round trip fewer per host): the host starts its servers only when it passes the check,
        which it answers first; the reasons it did not are the same as `_check`'s."""
        tasks = hp.tasks_in(only)
        self._check_start_step(hp, tasks)
        try:
            argv = hp.check_start_argv(only, tf_version, *self._reach(hp), keep=t.keeps_step)
            r = self._launch(t, hp, argv, only, 2, CHECK_TIMEOUT + hp.start_timeout + 30 + MESH_TIMEOUT, upload=True)
        except HostError:
            self.started.add(hp.name)  # its deadline: it may have started them, the rollback stops them
            raise
        lines = [line for line in r.stdout.splitlines() if line.strip()]
        check = self._checked(Result(r.exit_code, lines[0] if lines else "", r.stderr), hp, tf_version, only)
        self.started.add(hp.name)  # it passed the check: it started them
        return check, self._started(Result(r.exit_code, "\n".join(lines[1:]), r.stderr))

    def _checked(self, r: Result, hp: HostPlan, tf_version: str | None, only: Collection[str] | None
                 ) -> CheckReply:
        """The check's reply, or HostError with the reason the host cannot run its tasks."""
        if r.exit_code in (126, 127) and hp.managed:  # the shell's "not found" / "not executable"
            where = "on the PATH of an SSH command" if "/" not in hp.base_python else "there"
            raise HostError(f"no python3 on the host (looked for {hp.base_python!r} {where}; "
                            f"set base_python)")
        if r.exit_code in (126, 127):
            raise HostError(f"python missing: {hp.python!r} cannot be run there (set python: to the host's "
                            f"python with TensorFlow, or python: managed for an environment dtf builds)")
        check = decode(CheckReply, r, f"{hp.base_python or hp.python} (the host's python)")
        if hp.managed:
            if tf_version and tf_version != environment.TF_VERSION:
                raise HostError(f"TensorFlow mismatch: a managed environment holds dtf's pinned "
                                f"{environment.TF_VERSION}, this machine has {tf_version}")
        elif check.tensorflow is None:
            raise HostError(f"TensorFlow is not installed for {hp.python} (install "
                            f"tensorflow-cpu=={tf_version or environment.TF_VERSION} there, or set python: managed)")
        elif tf_version and check.tensorflow != tf_version:
            raise HostError(f"TensorFlow mismatch: {check.tensorflow} on the host ({hp.python}), "
                            f"{tf_version} on this machine")
        if hp.gpus_needed and check.gpus is not None and check.gpus < hp.gpus_needed:
            has = {0: "none", 1: "1 GPU (id 0)"}.get(check.gpus, f"{check.gpus} GPUs (ids 0-{check.gpus - 1})")
            raise HostError(f"gpus: the inventory gives its workers GPU id {hp.gpus_needed - 1}, but the "
                            f"host's NVIDIA driver lists {has}")
        if check.running and only is None:
            raise HostError(
                f"cluster {self.ops.plan.cluster!r} already runs here ({', '.join(check.running)} "
                f"in {hp.root}), started by another dtf (another DTF_HOME or machine): "
                f"`dtf down` it there, or name this cluster differently")
        if check.busy:
            raise HostError("port busy: " + ", ".join(
                f"{task.port} ({task.name})" for task in hp.tasks if task.port in check.busy))
        return check

    def _start_servers(self, t: CommandRunner, hp: HostPlan, only: Collection[str] | None) -> StartReply:
        tasks = hp.tasks_in(only)
        self.ops.step(hp, f"starting {len(tasks)} server(s)")
        self.started.add(hp.name)  # from here on, a rollback must stop tasks there
        argv = hp.start_argv_for(only, *self._reach(hp), keep=t.keeps_step)
        return self._started(self._launch(t, hp, argv, only, 1, hp.start_timeout + 30 + MESH_TIMEOUT))

    def _reach(self, hp: HostPlan) -> tuple[list[str], float]:
        """What the host's start checks it reaches once its servers serve (`mesh`), and for how long."""
        return (list(others(self.ops.plan, hp)) if self.mesh else []), MESH_TIMEOUT

    @staticmethod
    def _started(r: Result) -> StartReply:
        """The start's reply, or HostError: why it started nothing (`firewall: members` where it
        cannot set the rules), or the first server that crashed, with its log."""
        started = decode(StartReply, r, "starting servers")
        if started.refused:
            raise HostError(started.refused)
        failed = {n: s for n, s in started.tasks.items() if not s.ok}
        if failed:
            name, s = next(iter(failed.items()))
            log = " | ".join(line.strip() for line in s.log_tail[-5:] if line.strip())
            raise HostError(f"server crashed: {name}: {s.reason}" + (f"; log: {log}" if log else ""))
        return started

    def _launch(self, t: CommandRunner, hp: HostPlan, argv: list[str], only: Collection[str] | None, lines: int,
                timeout: float, upload: bool = False) -> Result:
        """The launcher's start (or check-start) of the host's tasks, `lines` its replies, in one
        round trip with the launcher's upload (`upload`) where the runner can (CommandRunner.start_servers:
        on a Slurm node, one job step that stays as long as the supervisors it forks)."""
        if upload:
            self.touched.add(hp.name)  # from here on, a rollback must remove what we put there
        names = "+".join(task.name for task in hp.tasks_in(only))
        return t.start_servers(ServerStart(
            argv, f"dtf-{self.ops.plan.cluster}-{names}"[:120], lines, timeout,
            upload=(shipping.launcher_bytes(), hp.root, shipping.launcher_name()) if upload else None))

    def _reachable(self, t: CommandRunner, hp: HostPlan, tasks: Sequence[TaskPlan]) -> bool:
        """Check that this machine reaches every task as the plan's network says (HostError where
        it does not); whether the TF ports accept connections from here directly."""
        return route.check_reach(self.ops.plan, t, hp, tasks)


class _Gate:
    """Where hosts start in turns and are told when to check the mesh (Starter._told_start): at most
    `at_once` hosts at once until their servers serve (`slot`); then each waits until every host has
    got that far or failed (`all_serve`: True when every one serves), for at most `wait` seconds
    (every turn's deadlines; each host's own are shorter)."""

    def __init__(self, hosts: int, at_once: int, wait: float, cancel: threading.Event) -> None:
        self.slot = threading.BoundedSemaphore(at_once)
        self.wait = wait
        self._cancel = cancel
        self._left = hosts
        self._all_ok = True
        self._changed = threading.Condition()

    def arrive(self, ok: bool) -> None:
        with self._changed:
            self._left -= 1
            self._all_ok = self._all_ok and ok
            # Only the outcome wakes the hosts waiting in all_serve (every host arrived, or one
            # failed): a wake-up of every waiting host at each arrival is one per host and arrival,
            # so each host's share of the laptop's CPU would grow with the number of hosts.
            if self._left <= 0 or not ok:
                self._changed.notify_all()

    def all_serve(self) -> bool:
        deadline = time.monotonic() + self.wait
        with self._changed:
            while self._left > 0 and self._all_ok and not self._cancel.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, GATE_POLL))
            return self._all_ok and not self._cancel.is_set()
