"""The Slurm provider: the plan's hosts are the nodes of its allocation, every command a job step
started through the login host (dtf.providers.slurm.steps), the training's route through the
login host alone; the allocation ends (a lost node, a preemption, its time limit), and `down`
cancels the one dtf submitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtf.cluster.allocation import Allocation
from dtf.cluster.plan import HostPlan, Plan
from dtf.errors import HostFailure
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.providers.provider import AllocationReport, Provider, Say, StartAnew
from dtf.providers.slurm import allocation as slurm_ops
from dtf.providers.slurm import commands as slurm
from dtf.providers.slurm.commands import JobState, gpu_note
from dtf.providers.slurm.steps import SlurmStepRunner

if TYPE_CHECKING:
    from dtf.cluster.state import Record
    from dtf.hosts.tunnel import Tunnel


class SlurmProvider(Provider):
    ends = True

    def __init__(self, plan: Plan, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        super().__init__(plan, connect_timeout)
        assert plan.allocation is not None
        self.allocation: Allocation = plan.allocation

    def login(self) -> CommandRunner:
        """The login host's runner: the cluster's connection to it, kept for the lease."""
        return self.connections.runner(self.allocation.login, self.plan.ttl)

    def runner(self, hp: HostPlan) -> CommandRunner:
        return SlurmStepRunner(hp.spec, self.allocation, self.login())

    def start_copies(self, hosts: Sequence[HostPlan], per_host: int, argv: list[str], gpus: bool = True) -> bool:
        """Every copy as ONE job step of the allocation (`srun --ntasks=N`, detached on the login
        host), as the user's own srun would: each copy sees the step's own Slurm environment."""
        a = self.allocation
        step = slurm.program_step_argv(a.job, [hp.name for hp in hosts], per_host, self.plan.cluster, argv,
                                       gpus=slurm.gpu_options(a.request) if gpus else ())
        try:
            with self.login() as t:
                slurm_ops.detach_step(t, step)
        except HostError as e:
            raise HostFailure("starting the program (a Slurm job step)", {a.login.host: str(e)})
        return True

    def copies_notes(self) -> list[str]:
        if not self.plan.hosts:
            return []
        spec = self.plan.hosts[0].spec  # every node has the same layout
        note = gpu_note(spec.gpus, len(spec.worker_ports))
        return [note] if note else []

    def tunnel(self) -> Tunnel:
        # Only the login host is reached by SSH: every task through it, and the tasks reach the
        # coordinator back through its relay (dtf.providers.slurm.relay).
        from dtf.providers.slurm.relay import LoginRelay

        login = self.allocation.login
        nodes = self.allocation.addresses
        return self.connections.tunnel([(login, [t.address for t in self.plan.tasks()])], {login.host: self.plan.ttl},
                                       way_back=lambda port: LoginRelay(self.login(), port, nodes, login.python))

    def job(self, what: str = "dtf status") -> tuple[JobState, str | None]:
        """The job as squeue shows it, and unless it runs, one line on why (allocation_state)."""
        return slurm_ops.allocation_state(self.allocation, self.plan.cluster, self.plan.ssh_config, self.plan.ttl,
                                          self.connect_timeout, what=what)

    def ended(self, what: str = "dtf train") -> str | None:
        return self.job(what)[1]

    def report(self, record: Record, what: str = "dtf status") -> AllocationReport:
        job, ended = self.job(what)
        a = self.allocation
        doc = {"job": a.job, "submitted_by_dtf": a.submitted, "state": job.state or "gone", "reason": job.reason,
               "time_used": job.used, "time_left": job.left, "nodes": list(a.nodes), "ended": ended,
               "allocation": record.allocation, "replaced": list(record.replaced)}
        whose = "submitted by dtf" if a.submitted else "yours"
        if record.replaced:  # `dtf train` replaced an ended job (dtf.providers.slurm.reallocate)
            whose += f"; allocation {record.allocation}, after job {record.replaced[-1].split(':', 1)[0]} ended"
        line = f"slurm job {a.job} ({whose}): " + (
            f"{job.state}, time used {job.used}, left {job.left}" if not job.gone else
            "no longer in the queue: its tasks ended with it (`dtf down` forgets it)")
        return AllocationReport("slurm", doc, line, ended,
                                forget=" (`dtf down` forgets it)" if job.state != "RUNNING" else "")

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
