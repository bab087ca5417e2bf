"""The Slurm provider: the plan's hosts are the nodes of its allocation, every command a job step
started through the login host (dtf.providers.slurm.steps), the training's route through the
login host alone; the allocation ends (a lost node, a preemption, its time limit), and `down`
cancels the one dtf submitted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtf.cluster.allocation import Allocation
from dtf.cluster.plan import HostPlan, Plan
from dtf.errors import HostFailure
from dtf.hosts.base import HostError, Transport
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.providers.provider import Provider, Say, StartAnew
from dtf.providers.slurm import allocation as slurm_ops
from dtf.providers.slurm.commands import JobState
from dtf.providers.slurm.steps import SlurmStepTransport

if TYPE_CHECKING:
    from dtf.cluster.state import Record
    from dtf.hosts.tunnel import Tunnel


class SlurmProvider(Provider):
    ends = True

    def __init__(self, plan: Plan, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        super().__init__(plan, connect_timeout)
        assert plan.slurm is not None
        self.allocation: Allocation = plan.slurm

    def login(self) -> Transport:
        """The login host's runner: the cluster's connection to it, kept for the lease."""
        return self.connections.runner(self.allocation.login, self.plan.ttl)

    def runner(self, hp: HostPlan) -> Transport:
        return SlurmStepTransport(hp.spec, self.allocation, self.login())

    def tunnel(self) -> Tunnel:
        # Only the login host is reached by SSH: every task through it, and the tasks reach the
        # coordinator back through its relay (dtf.providers.slurm.relay).
        from dtf.providers.slurm.relay import LoginRelay

        login = self.allocation.login
        nodes = self.allocation.addresses
        return self.connections.tunnel([(login, [t.address for t in self.plan.tasks()])], {login.host: self.plan.ttl},
                                       way_back=lambda master, port: LoginRelay(master, port, nodes, login.python))

    def job(self, what: str = "dtf status") -> tuple[JobState, str | None]:
        """The job as squeue shows it, and unless it runs, one line on why (allocation_state)."""
        return slurm_ops.allocation_state(self.allocation, self.plan.cluster, self.plan.ssh_config, self.plan.ttl,
                                          self.connect_timeout, what=what)

    def ended(self, what: str = "dtf train") -> str | None:
        return self.job(what)[1]

    def gone(self) -> bool:
        try:  # over the cluster's master to the login host, which `down` goes on using
            with self.login() as t:
                return slurm_ops.job_state(t, self.allocation.job).gone
        except HostError as e:
            raise HostFailure("dtf down (Slurm)", {self.allocation.login.host: str(e)})

    def replaceable(self) -> bool:
        return self.allocation.submitted

    def reallocate(self, record: Record, ended: str, *, wait: float, say: Say, start_anew: StartAnew) -> Record:
        from dtf.providers.slurm.reallocate import comeback

        return comeback(record, ended, wait=wait, connect_timeout=self.connect_timeout, say=say,
                        start_anew=start_anew)

    def gone_line(self) -> str:
        return f"job {self.allocation.job} is no longer in the queue: its tasks ended with it"

    def release(self, say: Say) -> bool:
        # Over the login host's master still (no new handshake); it closes the cluster's masters after.
        slurm_ops.release(self.allocation, self.plan.ssh_config, say, self.connect_timeout, cluster=self.plan.cluster)
        return self.allocation.submitted

    def close(self) -> None:
        self.connections.close([hp.spec for hp in self.plan.hosts] + [self.allocation.login])
