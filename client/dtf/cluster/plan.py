"""The plan: which task runs on which host and port, at which address, with which command.

Pure: `make_plan(inventory, resolve=...)` does no I/O. Every address a task is reached at comes
from here and only here (the cluster spec of `dtf train` is `plan.cluster_spec()`), so a later
tunnel mode can remap all of them in one place. A plan is plain data: it round-trips through
`to_dict`/`from_dict` into the local state file.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from dtf.cluster import gpus
from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory.model import DEFAULT_HOST_TIMEOUT, DEFAULT_PYTHON, HostSpec, Inventory, Position
from dtf.files import environment, shipping
from dtf_server.protocol import (
    CheckRequest,
    CheckStartRequest,
    CleanRequest,
    Defaults,
    EnvRequest,
    FakeRequest,
    Firewall,
    Layout,
    LogRequest,
    PurgeRequest,
    ReachRequest,
    RenewRequest,
    Request,
    ServeRequest,
    StartRequest,
    StatusRequest,
    StopRequest,
    SyncRequest,
    TaskSpec,
)

JOBS = ("ps", "worker")
# gRPC keepalive on every channel TensorFlow opens, servers' and the coordinator's (TensorFlow
# reads TF_GRPC_DEFAULT_OPTIONS for each: tsl/distributed_runtime/rpc/grpc_channel.cc,
# CreateDefaultChannelArguments): a connection whose peer vanished (a host cut off, a NAT that
# forgot it) fails once a ping goes unanswered for keepalive_timeout, instead of stalling its calls
# until TCP gives up. Pings only while calls are in flight, and at most two without data in
# between: below what a gRPC server counts as abuse (it cannot be told more).
GRPC_KEEPALIVE = "grpc.keepalive_time_ms=30000,grpc.keepalive_timeout_ms=20000"
# The environment of every server: fail fast on a dead peer instead of retrying (GRPC_FAIL_FAST, as
# tensorflow/docs' parameter_server_training tutorial sets it on every task).
TASK_ENV = (("GRPC_FAIL_FAST", "use_caller"), ("PYTHONUNBUFFERED", "1"),
            ("TF_GRPC_DEFAULT_OPTIONS", GRPC_KEEPALIVE))
START_TIMEOUT = Defaults.START_TIMEOUT
DEFAULT_TTL = Defaults.TTL  # seconds an unused cluster lives: see `dtf up --ttl`
# What serves a task: TensorFlow's server, or (for tests) a fake one, with options (its request's
# fields), e.g. "tensorflow:full" (the server runs `import tensorflow`, not only its server module:
# see dtf_server/tfserve.py), "fake:ready_delay=1.5,ignore_term", "fake:ready_file=PATH" (dtf_server/fake.py).
SERVERS = {"tensorflow": ("full",), "fake": ("ready_delay", "ignore_term", "ready_file")}
_SERVER_REQUESTS: dict[str, type[ServeRequest] | type[FakeRequest]] = {"tensorflow": ServeRequest, "fake": FakeRequest}


def task_argv(spec: HostSpec, argv: tuple[str, ...], job: str, port: int) -> tuple[str, ...]:
    """A task's command with the GPUs it may see set before it (dtf.cluster.gpus; nothing without `gpus`)."""
    position = spec.worker_ports.index(port) if job == "worker" else 0
    return (*gpus.env_prefix(gpus.task_env(spec.gpus, job, position, len(spec.worker_ports))), *argv)


def launcher_path(root: str) -> str:
    """This dtf's launcher below a cluster's root on a host (named by its content)."""
    return posixpath.join(root, shipping.launcher_name())


def server_argv(server: str, python: str, launcher: str, job: str, index: int, port: int,
                ready: str) -> tuple[str, ...]:
    """The command that serves one task: what its supervisor runs (ValueError: a bad `server`)."""
    kind, _, options = server.partition(":")
    if kind not in SERVERS:
        raise ValueError(f"expected one of {', '.join(SERVERS)}, got {server!r}")
    request = _SERVER_REQUESTS[kind]
    given: dict[str, Any] = {}
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key not in SERVERS[kind]:
            raise ValueError(f"unknown option {key!r} of {kind} in {server!r}")
        convert = request.kind_of(key)
        if convert is bool and value:
            raise ValueError(f"option {key!r} of {kind} takes no value, got {value!r} in {server!r}")
        given[key] = True if convert is bool else convert(value)
    return (python, launcher, *request(job=job, index=index, port=port, ready=ready, **given).args())


@dataclass(frozen=True)
class TaskPlan:
    job: str
    index: int
    host: str  # the inventory host name
    port: int
    address: str  # "addr:port": how every other task, and the laptop, reach this task
    dir: str  # the task's directory on its host (log, pid.json, ready.json)
    serve_argv: tuple[str, ...]  # exactly what the task's supervisor runs

    def spec(self) -> TaskSpec:
        return TaskSpec(job=self.job, index=self.index, port=self.port, argv=list(self.serve_argv))

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"

    @property
    def log(self) -> str:
        return posixpath.join(self.dir, Layout.LOG)

    @property
    def addr_host(self) -> str:
        return self.address.rsplit(":", 1)[0]


@dataclass(frozen=True)
class HostPlan:
    spec: HostSpec
    python: str  # the python that runs the launcher there
    root: str  # {workdir}/{cluster}: everything dtf puts on this host lives below it
    tasks: tuple[TaskPlan, ...]
    env: tuple[tuple[str, str], ...]
    start_timeout: float
    ttl: float = DEFAULT_TTL  # the lease: seconds without renewal before the tasks stop themselves
    server: str = "tensorflow"  # see SERVERS
    # `python: managed`: the environment's directory on the host (`python` is its bin/python) and
    # what it holds; `base_python` builds it and runs the launcher until it exists.
    env_dir: str | None = None
    requirements: tuple[str, ...] = ()
    base_python: str = ""
    # The start's firewall rules (`Plan.firewall_args`: derived from the plan, never read back).
    firewall: Firewall = dataclasses.field(default_factory=Firewall)

    @property
    def name(self) -> str:
        return self.spec.host

    @property
    def managed(self) -> bool:
        return self.env_dir is not None

    @property
    def gpus_needed(self) -> int:
        """How many GPUs the host must have for its `gpus` (its highest id + 1; 0 without `gpus`)."""
        return max(self.spec.gpus) + 1 if self.spec.gpus else 0

    @property
    def wheels_dir(self) -> str:
        return environment.wheels_dir(self.spec.workdir)

    def env_argv(self, uv: str, requirements_file: str) -> list[str]:
        """Build the managed environment (with the base python: the environment does not exist yet)."""
        assert self.env_dir is not None
        return self.base_launcher_argv(EnvRequest(env=self.env_dir, wheels=self.wheels_dir, uv=uv,
                                                  requirements=requirements_file))

    def purge_argv(self) -> list[str]:
        """Remove WORKDIR/.cache (`dtf down --purge`): run by the base python, never from inside
        the environment it removes."""
        return self.base_launcher_argv(PurgeRequest(workdir=self.spec.workdir))

    @property
    def launcher(self) -> str:
        """This dtf's launcher on the host: a path named by its content, so a launcher of another
        version is never used (and never computed from an old record)."""
        return launcher_path(self.root)

    @property
    def helpers(self) -> str:
        """dtf's own package, zipped, beside the launcher (collective mode's copies import it)."""
        return posixpath.join(self.root, shipping.helpers_name())

    def launcher_argv(self, request: Request) -> list[str]:
        """The launcher's command `request` on this host, run by its python."""
        return [self.python, self.launcher, *request.args()]

    def bare_launcher_argv(self, request: Request) -> list[str]:
        """A launcher command that needs the standard library only (start, a Slurm task's
        supervisor, status, renew, stop, reach; not `check`, which reads the site's TensorFlow):
        `python -S`, without the site's .pth files, which cost a python start time too."""
        return [self.python, "-S", self.launcher, *request.args()]

    def base_launcher_argv(self, request: Request) -> list[str]:
        """A launcher command run by the base python (`python: managed`: the python that builds
        the environment, which may not exist yet or may be removed by the command)."""
        return [self.base_python or self.python, self.launcher, *request.args()]

    def tasks_in(self, only: Collection[str] | None) -> list[TaskPlan]:
        """Every task of this host, or the ones named in `only`."""
        return [t for t in self.tasks if only is None or t.name in only]

    def task_names(self, only: Collection[str] | None = None) -> list[str]:
        """Every task's name (JOB:INDEX) of this host, or of the tasks named in `only`."""
        return [t.name for t in self.tasks_in(only)]

    @property
    def start_argv(self) -> list[str]:
        return self.start_argv_for(None)

    def start_argv_for(self, only: Collection[str] | None, reach: Collection[str] = (), reach_timeout: float = 0,
                       keep: bool = False) -> list[str]:
        """Start the tasks (or those in `only`). `reach`: then check that the host connects to
        these ADDR:PORTs (the other hosts' tasks, which may still be starting: each gets
        `reach_timeout` seconds). `keep`: a Slurm node's job step, which stays as long as the
        supervisors it starts (dtf.providers.slurm.steps: start_servers)."""
        return self.bare_launcher_argv(StartRequest(**self._start(only, reach, reach_timeout, keep)))

    def _start(self, only: Collection[str] | None, reach: Collection[str] = (), reach_timeout: float = 0,
               keep: bool = False, told: float = 0) -> dict[str, Any]:
        """The fields of this host's StartRequest (and of its CheckStartRequest)."""
        checked = {"reach": list(reach), "reach_timeout": reach_timeout,
                   **({"reach_when_told": told} if told else {})} if reach else {}
        return {"dir": self.root, "timeout": self.start_timeout, "ttl": self.ttl,
                "restart_limit": self.spec.restart_limit, "restart_backoff": self.spec.restart_backoff,
                "env": [f"{k}={v}" for k, v in self.env], "keep": keep, "firewall": self.firewall, **checked,
                "task": [t.spec() for t in self.tasks_in(only)]}

    def check_start_argv(self, only: Collection[str] | None, tensorflow: str | None,
                         reach: Collection[str] = (), reach_timeout: float = 0, keep: bool = False,
                         told: float = 0) -> list[str]:
        """`check_argv` and `start_argv_for` in one launcher call (a host with its own python):
        the host starts its servers when it passes the check (`tensorflow`: the laptop's version,
        the host's must be the same; a fresh start, `only` None, refuses a cluster running there).
        `told`: it checks it reaches `reach` once told on its stdin, waiting that long for it."""
        return self.launcher_argv(CheckStartRequest(
            port=[t.port for t in self.tasks_in(only)], tensorflow=tensorflow or "", fresh=only is None,
            gpus=self.gpus_needed, **self._start(only, reach, reach_timeout, keep, told)))

    def check_argv(self, only: Collection[str] | None = None) -> list[str]:
        ports = [t.port for t in self.tasks_in(only)]
        if self.env_dir is None:
            return self.launcher_argv(CheckRequest(dir=self.root, port=ports))
        # The base python: the environment may not exist yet; `check` says whether it is complete.
        return self.base_launcher_argv(CheckRequest(dir=self.root, port=ports, env=self.env_dir,
                                                    wheels=self.wheels_dir))

    def status_argv(self, renew: bool = True) -> list[str]:
        """Status of every task; renews the lease (whoever asks is using the cluster) unless not
        `renew`."""
        return self.bare_launcher_argv(StatusRequest(dir=self.root, renew=renew, task=self.task_names()))

    def log_argv(self, task: str, lines: int, follow: bool = False, everything: bool = False) -> list[str]:
        """A task's last `lines` lines, without TensorFlow's own unless `everything`; `follow`: then
        its new lines as they come (`dtf logs`: dtf_server.tflog decides which lines are TensorFlow's)."""
        return self.bare_launcher_argv(LogRequest(dir=self.root, task=task, lines=lines, follow=follow,
                                                  all=everything))

    def renew_argv(self, ttl: float | None = None) -> list[str]:
        return self.bare_launcher_argv(RenewRequest(dir=self.root, ttl=ttl))

    def stop_argv(self, grace: float, only: Collection[str] | None = None, clean: bool = False,
                  keep_logs: bool = False) -> list[str]:
        """Stop the tasks (or those in `only`); with `clean`, once all are gone remove dtf's files
        too (`clean_argv`), in the same command."""
        return self.bare_launcher_argv(StopRequest(dir=self.root, grace=grace, task=self.task_names(only),
                                                   clean=clean, keep_logs=clean and keep_logs))

    def reach_argv(self, targets: Collection[str], timeout: float) -> list[str]:
        """Which targets this host cannot connect to; renews the lease (`up`'s last step: the
        lease counts from the end of `up`)."""
        return self.bare_launcher_argv(ReachRequest(dir=self.root, timeout=timeout, to=list(targets)))

    def sync_argv(self, digest: str, receive: bool = False, *, free_port: bool = False, source: str = "",
                  serve: int = 0, children: int = 0, token: str = "", wait: float = 0) -> list[str]:
        """Whether the host holds the synced tree DIGEST (`free_port`: and a port free there);
        `receive`: make it from stdin (dtf.files.sync), or from another host's relay at `source`
        (ADDR:PORT), passing it on to `children` hosts from port `serve` (dtf_server.receive)."""
        relay = {"serve": serve, "children": children} if serve and children else {}
        return self.launcher_argv(SyncRequest(dir=Layout.cache_dir(self.spec.workdir, "sync"), hash=digest,
                                              receive=receive, free_port=free_port, source=source or None,
                                              token=token, wait=wait or None, **relay))

    def clean_argv(self, keep_logs: bool, if_unused: bool = False) -> list[str]:
        """Run by the base python: a managed environment may be gone (`--purge`) or not built yet."""
        return self.base_launcher_argv(CleanRequest(dir=self.root, keep_logs=keep_logs, if_unused=if_unused))


@dataclass(frozen=True)
class SyncItem:
    """A local path `up` sends to every host (the inventory's `sync:`), named for dtf.synced()."""

    name: str
    path: str  # absolute, on this machine
    line: int = 0  # of its entry in the inventory (for "no such file"), 0: unknown
    column: int = 0


@dataclass(frozen=True)
class Plan:
    cluster: str
    inventory: str
    ssh_config: str | None
    hosts: tuple[HostPlan, ...]
    network: str = "auto"  # how the laptop reaches the tasks: inventory.NETWORKS (`up` decides auto)
    firewall: str = "auto"  # inventory.FIREWALLS: who may connect to the TF ports (`firewall_args`)
    sync: tuple[SyncItem, ...] = ()  # sent to every host at `up`: not a change of the cluster
    # The scheduler's job (Slurm) whose nodes the hosts are, reached through its login host; None:
    # the inventory's own hosts.
    allocation: Allocation | None = None
    # Where the inventory names ssh_config (for its errors after `up`: check_ssh_config); 0: unknown.
    ssh_config_line: int = 0
    ssh_config_column: int = 0
    # `spares:`: hosts that stand by, without tasks (each spec's address resolved); `host_timeout`:
    # how long a host may go unanswered under `dtf train` before its tasks move to a spare;
    # `moved`: (lost host, spare) of each move made, in order (`moved_to`).
    spares: tuple[HostPlan, ...] = ()
    host_timeout: float = DEFAULT_HOST_TIMEOUT
    moved: tuple[tuple[str, str], ...] = ()
    # Hosts whose tasks moved to a spare, as they were (their old tasks may run on there, where the
    # host answers again): kept until their tasks are stopped and their files removed.
    retired: tuple[HostPlan, ...] = ()
    # The inventory's `coordinator:` (a detached run's host: dtf.detached); None: its default.
    coordinator: str | None = None

    def ssh_config_position(self, inventory: str) -> Position:
        """Where `inventory`, the file this plan was made from, names ssh_config."""
        return Position(inventory, self.ssh_config_line or 1, self.ssh_config_column or 1)

    @property
    def ttl(self) -> float:
        """The cluster's lease (every host has the same)."""
        return self.hosts[0].ttl if self.hosts else DEFAULT_TTL

    @property
    def remote_hosts(self) -> tuple[HostPlan, ...]:
        """The hosts reached over SSH (local hosts are this machine: always reached directly)."""
        return tuple(hp for hp in self.hosts if not hp.spec.local)

    def network_for(self, hp: HostPlan) -> str:
        """How `up` checks that this machine reaches the host's tasks: direct, ssh, or auto
        (direct if it can). Local hosts are this machine: direct. With `firewall: members` the
        laptop is no member, so auto means ssh (only `network: direct` lets the laptop in)."""
        if hp.spec.local:
            return "direct"
        if self.network == "auto" and self.firewall == "members":
            return "ssh"
        return self.network

    def firewall_args(self, hp: HostPlan) -> Firewall:
        """The host's start closes its TF ports first (dtf_server.firewall) to all but the cluster's
        hosts and loopback; and this machine, as the host sees it (its SSH client), unless it
        reaches the tasks through SSH; and on a Slurm node the login host, at the address the node
        sees it from (the step's SLURM_LAUNCH_NODE_IPADDR): dtf's connections to the tasks come
        through it. Every port of the host: a repair starts only some of its tasks. The spares are
        let in from the start: tasks moved to one reach the other hosts' tasks with no rule to
        change there. Nothing for `firewall: off`."""
        if self.firewall == "off":
            return Firewall()
        members = dict.fromkeys([*self.members(), *(default_address(sp.spec) for sp in self.spares)])
        return Firewall(mode=self.firewall, ports=[t.port for t in hp.tasks], allow=list(members),
                     client=not hp.spec.local and self.network_for(hp) != "ssh", launch_node=hp.spec.allocated)

    def with_firewalls(self) -> Plan:
        """This plan with each host's `firewall` (its start's firewall rules)."""
        return dataclasses.replace(self, hosts=tuple(dataclasses.replace(hp, firewall=self.firewall_args(hp))
                                                     for hp in self.hosts))

    def tasks(self) -> list[TaskPlan]:
        """Every task, ps first, each job by index."""
        all_tasks = [t for h in self.hosts for t in h.tasks]
        return sorted(all_tasks, key=lambda t: (JOBS.index(t.job), t.index))

    def task(self, name: str) -> TaskPlan | None:
        return next((t for t in self.tasks() if t.name == name), None)

    def members(self) -> list[str]:
        """The addresses the tasks reach each other at, one per host."""
        return list(dict.fromkeys(t.addr_host for t in self.tasks()))

    def host_of(self, task: TaskPlan) -> HostPlan:
        return next(h for h in self.hosts if task in h.tasks)

    def cluster_spec(self) -> dict[str, list[str]]:
        """The ps and worker addresses, by index: what the coordinator's TF_CONFIG holds."""
        spec: dict[str, list[str]] = {job: [] for job in JOBS}
        for t in self.tasks():
            spec[t.job].append(t.address)
        return spec

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        firewall = data.get("firewall", "off")
        return cls(cluster=data["cluster"], inventory=data["inventory"],
                   ssh_config=data["ssh_config"], hosts=tuple(_host_from_dict(h) for h in data["hosts"]),
                   network=data.get("network", "direct"), firewall="off" if firewall == "none" else firewall,
                   sync=tuple(SyncItem(**item) for item in data.get("sync", ())),
                   allocation=Allocation.from_dict(data["allocation"]) if data.get("allocation") else None,
                   ssh_config_line=data.get("ssh_config_line", 0), ssh_config_column=data.get("ssh_config_column", 0),
                   spares=tuple(_host_from_dict(h) for h in data.get("spares", ())),
                   host_timeout=float(data.get("host_timeout", DEFAULT_HOST_TIMEOUT)),
                   moved=tuple((str(a), str(b)) for a, b in data.get("moved", ())),
                   retired=tuple(_host_from_dict(h) for h in data.get("retired", ())),
                   coordinator=data.get("coordinator")).with_firewalls()

    def spare(self, name: str) -> HostPlan | None:
        return next((sp for sp in self.spares if sp.name == name), None)

    def moved_to(self, lost: str, spare: str) -> Plan:
        """This plan with host `lost`'s tasks on spare `spare` (same jobs, indexes and ports; the
        spare's address, python and workdir), the spare in the lost host's place, gone from
        `spares`; the lost host is no longer one of the plan's hosts, but one of its `retired`
        (ValueError: no such host or spare)."""
        hp = next((h for h in self.hosts if h.name == lost), None)
        sp = self.spare(spare)
        if hp is None or sp is None:
            raise ValueError(f"cannot move {lost!r} to {spare!r}: no such host or spare")
        spec = dataclasses.replace(sp.spec, ps_ports=hp.spec.ps_ports, worker_ports=hp.spec.worker_ports)
        address = default_address(spec)
        launcher = launcher_path(sp.root)
        tasks = []
        for t in hp.tasks:
            tdir = Layout.task_dir(sp.root, t.job, t.index)
            ready = posixpath.join(tdir, Layout.READY)
            argv = server_argv(hp.server, sp.python, launcher, t.job, t.index, t.port, ready)
            tasks.append(TaskPlan(job=t.job, index=t.index, host=spare, port=t.port, address=f"{address}:{t.port}",
                                  dir=tdir, serve_argv=task_argv(spec, argv, t.job, t.port)))
        new = dataclasses.replace(sp, spec=spec, tasks=tuple(tasks), env=hp.env, start_timeout=hp.start_timeout,
                                  ttl=hp.ttl, server=hp.server)
        return dataclasses.replace(self, hosts=tuple(new if h.name == lost else h for h in self.hosts),
                                   spares=tuple(s for s in self.spares if s.name != spare),
                                   moved=(*self.moved, (lost, spare)),
                                   retired=(*self.retired, dataclasses.replace(hp, firewall=Firewall()))
                                   ).with_firewalls()

    def without_retired(self, names: Collection[str]) -> Plan:
        """This plan with the retired hosts named cleaned: no longer kept."""
        return dataclasses.replace(self, retired=tuple(h for h in self.retired if h.name not in names))

    def with_moves(self, moves: Collection[tuple[str, str]]) -> Plan:
        """This plan (an inventory's) with the moves a running cluster made, where they still apply:
        what `dtf up` from the same inventory compares with the cluster's record."""
        plan = self
        for lost, spare in moves:
            if any(h.name == lost for h in plan.hosts) and plan.spare(spare) is not None:
                plan = plan.moved_to(lost, spare)
        return plan


def _host_from_dict(h: dict[str, Any]) -> HostPlan:
    spec = dict(h["spec"])
    spec["ps_ports"] = tuple(spec["ps_ports"])
    spec["worker_ports"] = tuple(spec["worker_ports"])
    if spec.get("gpus") is not None:
        spec["gpus"] = tuple(spec["gpus"])
    spec["packages"] = tuple(spec.get("packages", ()))
    host_spec = HostSpec(**spec)
    server = h.get("server", "tensorflow")
    launcher = launcher_path(h["root"])
    # The serve command is derived again, never read back: it names this dtf's launcher.
    tasks = tuple(TaskPlan(**{**t, "serve_argv": task_argv(host_spec, server_argv(
        server, h["python"], launcher, t["job"], t["index"], t["port"],
        posixpath.join(t["dir"], Layout.READY)), t["job"], t["port"])}) for t in h["tasks"])
    return HostPlan(
        spec=host_spec, python=h["python"], root=h["root"], tasks=tasks,
        env=tuple((k, v) for k, v in h["env"]), start_timeout=h["start_timeout"],
        ttl=h.get("ttl", DEFAULT_TTL), server=server, env_dir=h.get("env_dir"),
        requirements=tuple(h.get("requirements", ())), base_python=h.get("base_python", ""),
    )


def default_address(spec: HostSpec) -> str:
    """The address of a host's TF servers when no resolver knows better."""
    if spec.address:
        return spec.address
    return "127.0.0.1" if spec.local else spec.host


def make_plan(
    inventory: Inventory,
    *,
    resolve: Callable[[HostSpec], str] = default_address,
    local_python: str = DEFAULT_PYTHON,
    start_timeout: float = START_TIMEOUT,
    ttl: float = DEFAULT_TTL,
    server: str = "tensorflow",
    network: str | None = None,
    allocation: Allocation | None = None,
) -> Plan:
    """Assign task indexes (in inventory order), addresses, directories and commands.

    `resolve` gives the address other tasks reach a host at (the CLI passes one that reads
    HostName from ssh_config); `local_python` is the python of local hosts that name none;
    `ttl` is the lease (`dtf up --ttl`, 0: never lapses); `server` what serves each task
    (ValueError if it is not one of SERVERS); `network` overrides the inventory's (`--network`).
    `allocation`: the one whose nodes are the inventory's hosts (`Inventory.with_nodes`); each
    node's servers are reached at its address there.
    """
    if allocation is not None:
        resolve = allocation.address_of_spec
    counters = {job: 0 for job in JOBS}
    hosts = []
    for spec in inventory.hosts:
        local = spec.local
        python = local_python if local and spec.python == DEFAULT_PYTHON else spec.python
        env_dir: str | None = None
        reqs: tuple[str, ...] = ()
        if spec.managed:
            reqs = environment.requirements(spec.accelerator, spec.packages)
            env_dir = environment.env_dir(spec.workdir, environment.env_hash(reqs, spec.accelerator, spec.base_python))
            python = posixpath.join(env_dir, "bin", "python")
        root = posixpath.join(spec.workdir, inventory.cluster)
        launcher = launcher_path(root)
        address = resolve(spec)
        tasks = []
        for job, ports in (("ps", spec.ps_ports), ("worker", spec.worker_ports)):
            for port in ports:
                index = counters[job]
                counters[job] += 1
                tdir = Layout.task_dir(root, job, index)
                tasks.append(TaskPlan(
                    job=job, index=index, host=spec.host, port=port, address=f"{address}:{port}",
                    dir=tdir, serve_argv=task_argv(spec, server_argv(server, python, launcher, job, index, port,
                                                                     posixpath.join(tdir, Layout.READY)), job, port),
                ))
        hosts.append(HostPlan(spec=spec, python=python, root=root, tasks=tuple(tasks),
                              env=TASK_ENV, start_timeout=start_timeout, ttl=ttl, server=server,
                              env_dir=env_dir, requirements=reqs,
                              base_python=spec.base_python if spec.managed else python))
    # A relative sync path is relative to the inventory's directory, as the user reads the file.
    base = os.path.dirname(os.path.abspath(inventory.path))
    sync = tuple(SyncItem(s.name, os.path.normpath(os.path.join(base, os.path.expanduser(s.path))), s.line,
                          s.column) for s in inventory.sync)
    at = inventory.position("ssh_config") if inventory.ssh_config else None
    # A spare: its python and root as a host's, no task; its address resolved now (for a move).
    spares = []
    for spec in inventory.spares:
        python = spec.python
        env_dir = None
        reqs = ()
        if spec.managed:
            reqs = environment.requirements(spec.accelerator, spec.packages)
            env_dir = environment.env_dir(spec.workdir, environment.env_hash(reqs, spec.accelerator, spec.base_python))
            python = posixpath.join(env_dir, "bin", "python")
        spares.append(HostPlan(spec=dataclasses.replace(spec, address=resolve(spec)), python=python,
                               root=posixpath.join(spec.workdir, inventory.cluster), tasks=(), env=TASK_ENV,
                               start_timeout=start_timeout, ttl=ttl, server=server, env_dir=env_dir,
                               requirements=reqs, base_python=spec.base_python if spec.managed else python))
    return Plan(cluster=inventory.cluster, inventory=inventory.path,
                ssh_config=inventory.ssh_config, hosts=tuple(hosts),
                network=network or inventory.network, firewall=inventory.firewall, sync=sync, allocation=allocation,
                ssh_config_line=at.line if at else 0, ssh_config_column=at.column if at else 0,
                spares=tuple(spares), host_timeout=inventory.host_timeout,
                coordinator=inventory.coordinator).with_firewalls()


_HOST_FIELDS = ("connection", "user", "port", "identity_file", "python", "workdir", "address",
                "restart_limit", "restart_backoff", "base_python", "packages", "accelerator", "gpus")


def differences(old: Plan, new: Plan) -> list[str]:
    """What changed from the plan a cluster was started with to a new one, one line per change
    (hosts and tasks added, removed or moved; host settings changed). Empty: the same cluster."""
    lines = [f"{key}: {getattr(old, key)!r} -> {getattr(new, key)!r}"
             for key in ("network", "firewall") if getattr(old, key) != getattr(new, key)]
    old_spares, new_spares = ([sp.name for sp in p.spares] for p in (old, new))
    if old_spares != new_spares:
        lines.append(f"spares: {', '.join(old_spares) or 'none'} -> {', '.join(new_spares) or 'none'}")
    old_hosts, new_hosts = ({h.name: h for h in p.hosts} for p in (old, new))
    lines += [f"host {name}: added" for name in new_hosts if name not in old_hosts]
    lines += [f"host {name}: removed" for name in old_hosts if name not in new_hosts]
    for name in (n for n in new_hosts if n in old_hosts):
        a, b = old_hosts[name], new_hosts[name]
        for key in _HOST_FIELDS:
            before, after = getattr(a.spec, key), getattr(b.spec, key)
            if before != after:
                lines.append(f"host {name}: {key} {before!r} -> {after!r}")
    old_tasks, new_tasks = ({t.name: t for t in p.tasks()} for p in (old, new))
    for name, t in new_tasks.items():
        if name not in old_tasks:
            lines.append(f"task {name}: added on {t.host} at {t.address}")
        elif (old_tasks[name].host, old_tasks[name].address) != (t.host, t.address):
            was = old_tasks[name]
            lines.append(f"task {name}: {was.host} {was.address} -> {t.host} {t.address}")
    for name, t in old_tasks.items():
        if name not in new_tasks:
            lines.append(f"task {name}: removed (was on {t.host} at {t.address})")
    return lines
