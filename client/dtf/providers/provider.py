"""The interface every provider has (`Provider`), and what the providers share: the cluster's SSH
connections (dtf.hosts.connections) and the lifecycle's defaults for a cluster whose hosts never
end (a provider that allocates them says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtf.cluster import state
from dtf.cluster.plan import HostPlan, Plan
from dtf.hosts.base import CommandRunner
from dtf.hosts.connections import Connections
from dtf.hosts.netutil import CONNECT_TIMEOUT

if TYPE_CHECKING:
    from dtf.cluster.inventory import Inventory
    from dtf.cluster.state import Record
    from dtf.hosts.tunnel import Tunnel

Say = Callable[[str], None]
# Starts the cluster anew from an inventory on a new allocation (dtf.hostops.realloc): its record.
StartAnew = Callable[["Inventory", float, str, "str | None"], "Record"]


@dataclass(frozen=True)
class AllocationReport:
    """What `dtf status` says of the hosts' allocation (a Slurm job): its JSON document under `key`,
    its line above the table, and while it no longer runs, why (`ended`, one line) and what `dtf
    down` then does (`forget`)."""

    key: str
    doc: dict[str, Any] = field(default_factory=dict)
    line: str = ""
    ended: str | None = None
    forget: str = ""


class Provider:
    """How dtf reaches the hosts of one plan (see the package). Constructors do no I/O."""

    # Whether the hosts' allocation can end under a run (a scheduler's job: its time limit, a
    # preemption, a lost node), so that `dtf train` asks `ended` while it waits.
    ends = False

    def __init__(self, plan: Plan, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.plan = plan
        self.connect_timeout = connect_timeout
        self.connections = Connections(state.home(), plan.cluster, plan.ssh_config, connect_timeout)

    # -- one host -------------------------------------------------------------------------------
    def runner(self, hp: HostPlan) -> CommandRunner:
        """How dtf runs commands, moves files and opens TCP connections on the host."""
        raise NotImplementedError

    def converses(self, hosts: Sequence[HostPlan]) -> bool:
        """Whether every host's start can be told when to check the mesh: a command whose stdin
        stays open while its output is read (CommandRunner.converse)."""
        return False

    # -- collective mode's program copies -------------------------------------------------------
    def start_copies(self, hosts: Sequence[HostPlan], per_host: int, argv: list[str], gpus: bool = True) -> bool:
        """Start a program's copies on `hosts` (`per_host` each) as ONE step of the hosts'
        allocation, each running `argv` (the launcher's `run-step`): True; False where each host's
        launcher starts its own copies (`run`). HostFailure where the step cannot start. `gpus`:
        the step asks for the allocation's GPUs (not for a detached run's coordinator)."""
        return False

    def copies_notes(self) -> list[str]:
        """What to say about the copies a collective run starts on these hosts (none)."""
        return []

    # -- the training's route -------------------------------------------------------------------
    def route(self, network: str) -> Tunnel | None:
        """What carries the program's connections to the tasks in the cluster's `network` (the
        record's): the tunnel through SSH (not open yet: enter it), or None where they go directly."""
        return self.tunnel() if network == "ssh" else None

    def tunnel(self) -> Tunnel:
        """The program's connections to the tasks through SSH (network: ssh; dtf.hosts.tunnel)."""
        raise NotImplementedError

    # -- the hosts' allocation ------------------------------------------------------------------
    def report(self, record: Record, what: str = "dtf status") -> AllocationReport | None:
        """The hosts' allocation as its scheduler shows it (None: the inventory's own hosts).
        HostFailure named after `what` where it cannot be asked."""
        return None

    def ended(self, what: str = "dtf train") -> str | None:
        """Why the hosts' allocation no longer runs, in one line (None: it runs). HostFailure
        named after `what` where it cannot be asked."""
        return None

    def gone(self) -> bool:
        """Whether the hosts are no longer the cluster's to reach (their allocation ended, and its
        end stopped every task): `dtf down` then has nothing to stop."""
        return False

    def replaceable(self) -> bool:
        """Whether dtf may replace the hosts' allocation with a new one when it ends (one dtf made)."""
        return False

    def reallocate(self, record: Record, ended: str, *, wait: float, say: Say, start_anew: StartAnew) -> Record:
        """A new allocation in place of the ended one (`ended`: why it ended), the cluster started on
        it by `start_anew`: the new record. ClusterDown in one line where it cannot be had."""
        raise NotImplementedError

    def gone_line(self) -> str:
        """What `dtf down` says where `gone`."""
        return "the hosts are gone: their tasks ended with them"

    def release(self, say: Say) -> bool:
        """Give the hosts back (`dtf down`, after the tasks stopped): True where that ended every
        task whatever the hosts said (an allocation dtf made, now cancelled)."""
        return False

    def close(self) -> None:
        """Close the cluster's connections (`dtf down`, a failed `up`)."""
        self.connections.close()
