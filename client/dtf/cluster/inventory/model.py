"""The inventory as data: the hosts, how to reach them, and which tasks run on each.

Plain, immutable dataclasses and the defaults they start from; no YAML here (dtf.cluster.inventory.loader
reads the file into them), so what only reads a cluster's record imports this alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from dtf_server.protocol import Defaults

DEFAULT_TF_PORT = 2222
DEFAULT_PYTHON = "python3"
MANAGED = "managed"  # `python: managed`: dtf builds the environment (see dtf.files.environment)
ACCELERATORS = ("none", "cuda")
DEFAULT_WORKDIR = "~/.dtf"
DEFAULT_RESTART_LIMIT = Defaults.RESTART_LIMIT  # host-side defaults live in one place
DEFAULT_RESTART_BACKOFF = Defaults.RESTART_BACKOFF
# Seconds a host may go unanswered while `dtf train` runs before its tasks move to a spare
# (`host_timeout`): past gRPC's keepalive (dtf.cluster.plan.GRPC_KEEPALIVE), so a host the
# training itself has not yet given up on is not replaced.
DEFAULT_HOST_TIMEOUT = 60.0


@dataclass(frozen=True)
class HostSpec:
    host: str  # as written: a name, an address, or a ~/.ssh/config alias
    line: int  # where this host's entry starts in the file (1-based), for later error messages
    connection: str  # "ssh", "local", or "slurm" (a node of a Slurm allocation: made by `with_nodes`)
    user: str | None  # None: ~/.ssh/config or the local user decides
    port: int | None  # SSH port; None: ~/.ssh/config or 22
    identity_file: str | None
    python: str  # the python that runs the launcher on that host
    workdir: str  # where dtf keeps its files on that host (may start with ~/)
    address: str | None  # the address other tasks reach this host's TF servers at; None: derived
    ps_ports: tuple[int, ...]  # one TF server port per ps task on this host
    worker_ports: tuple[int, ...]  # one TF server port per worker task on this host
    # The last fields have defaults: records saved before they existed still load (HostSpec(**d)).
    restart_limit: int = DEFAULT_RESTART_LIMIT  # restarts of a dead task's server before giving up; 0: never
    restart_backoff: float = DEFAULT_RESTART_BACKOFF  # seconds before a restart; doubles on quick deaths, max 60
    # `python: managed`: dtf builds the host's environment (dtf.files.environment) on `base_python`,
    # with the pinned TensorFlow (the CUDA build with accelerator cuda) plus `packages`.
    base_python: str = DEFAULT_PYTHON
    packages: tuple[str, ...] = ()
    accelerator: str = "none"
    gpus: tuple[int, ...] | None = None  # the host's GPU ids, shared among its workers (cluster/gpus.py); None: not set

    @property
    def managed(self) -> bool:
        return self.python == MANAGED

    @property
    def local(self) -> bool:
        """This machine: its tasks are local processes, reached directly (`connection: local`)."""
        return self.connection == "local"

    @property
    def over_ssh(self) -> bool:
        """A host of the inventory reached over SSH (not this machine, not a scheduler's node)."""
        return self.connection == "ssh"

    @property
    def allocated(self) -> bool:
        """A node of a scheduler's allocation (Slurm), reached through the host in front of it."""
        return self.connection == "slurm"


@dataclass(frozen=True)
class SyncSpec:
    """One entry of `sync:`: a local path sent to every host at `up` (dtf.files.sync)."""

    path: str  # as written (`~/` is this machine's home; relative: to the inventory's directory)
    name: str  # what dtf.synced(NAME) finds it by: `as`, else the path's last part
    line: int  # where the entry is (1-based), for "no such file" at `up`
    column: int


@dataclass(frozen=True)
class SlurmSpec:
    """`slurm:` in place of `hosts:`: the cluster's nodes come from a Slurm allocation, made through
    the login host (dtf.providers.slurm.commands builds the commands). Either `nodes` (dtf submits an
    allocation, and cancels it at `down`) or `job` (an allocation the user made: used, never
    cancelled)."""

    login: HostSpec  # the login host: an SSH host like any other (ssh_config, ProxyJump, agent); no tasks
    node: HostSpec  # what every node of the allocation runs: python, workdir, ports per node (host is "")
    line: int  # where `slurm:` is (1-based)
    nodes: int | None = None  # how many nodes to allocate; None with `job`
    job: str | None = None  # an existing allocation's id
    partition: str | None = None
    time: str | None = None  # Slurm's time limit, as written (`90`, `1:30:00`, `2-00:00:00`)
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = None
    sbatch: tuple[str, ...] = ()  # more allocation options (sbatch's, but for a batch script's), to salloc as written

    @property
    def submits(self) -> bool:
        """dtf makes the allocation (and so cancels it); False: the user's `job`."""
        return self.job is None


@dataclass(frozen=True)
class Position:
    """Where a value is written: the file, its 1-based line and column."""

    file: str
    line: int
    column: int


# How the laptop reaches the tasks' TF ports: directly, through SSH, or whichever works (auto).
NETWORKS = ("auto", "direct", "ssh")
# Who may connect to the tasks' TF ports (dtf_server.firewall; docs/security.md): only the cluster's
# hosts and the laptop where the host lets dtf set firewall rules, else anyone, said by `up` (auto);
# only those, or `up` refuses the host (members); anyone who can reach them (off).
FIREWALLS = ("auto", "members", "off")


@dataclass(frozen=True)
class Inventory:
    path: str  # the file it was read from, as given
    cluster: str  # the cluster's name
    hosts: tuple[HostSpec, ...]
    ssh_config: str | None  # an ssh_config file to read instead of ~/.ssh/config
    network: str = "auto"  # one of NETWORKS
    firewall: str = "auto"  # one of FIREWALLS
    sync: tuple[SyncSpec, ...] = ()  # sent to every host at `up`
    # `slurm:` in place of `hosts:` (hosts is then empty until the allocation names the nodes:
    # `with_nodes`).
    slurm: SlurmSpec | None = None
    # `spares:` hosts that stand by, with no task, for the tasks of a host lost for good
    # (dtf.hostops.repair); `host_timeout`: how long a host may go unanswered before it is lost.
    spares: tuple[HostSpec, ...] = ()
    host_timeout: float = DEFAULT_HOST_TIMEOUT
    # `coordinator:` the host a detached run's coordinator runs on (`dtf train --detach`); None: the
    # first host with a ps task.
    coordinator: str | None = None
    # Where each value is written, by the name its errors give it ("ssh_config", "hosts[1].port",
    # "sync[0]"): a key's position for a mapping's entry, an item's for a list's.
    positions: Mapping[str, Position] = field(default_factory=dict, compare=False, repr=False)

    def position(self, name: str) -> Position:
        """Where the value named `name` is written; the file's start where it is not."""
        return self.positions.get(name) or Position(self.path, 1, 1)

    def with_nodes(self, names: tuple[str, ...]) -> Inventory:
        """A Slurm inventory whose allocation runs on these nodes: one host per node, each with
        the node layout (`slurm.node`), in Slurm's order."""
        assert self.slurm is not None
        node = self.slurm.node
        return dataclasses.replace(self, hosts=tuple(dataclasses.replace(node, host=n) for n in names))

    @property
    def num_ps(self) -> int:
        return sum(len(h.ps_ports) for h in self.hosts)

    @property
    def num_workers(self) -> int:
        return sum(len(h.worker_ports) for h in self.hosts)

