"""The cluster as its coordinator's host sees it: the laptop's record made over for that host
(`vantage`), so that dtf's own code (the attempts, the lease, the repair: dtf.program.train) runs
there unchanged.

- The coordinator's own host is this machine: `connection: local` (its commands are processes).
- Every other SSH host is reached with the cluster key (dtf_server.detached: `authorize`) through
  an ssh_config of the run's own (`ssh_config`): the host's address in the cluster, the port and
  login its sshd gave the laptop, the key, and only the host keys each host's sshd showed itself
  (`known_hosts`); never the user's ~/.ssh/config, known_hosts or agent.
- A Slurm node reaches the others as the login host does, with job steps of the allocation: the
  login host is this machine (srun, squeue and scancel run on a job's nodes too). The coordinator
  is a job step of that allocation and ends with it: it never replaces it (its attempts end in one
  line where the job ends, as for the inventory's `job:`).
- The tasks are reached directly: the coordinator's host is one of the cluster's hosts.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from dtf.cluster.plan import HostPlan, Plan, default_address
from dtf.cluster.state import Record
from dtf_server.protocol import DetachedLayout


@dataclass(frozen=True)
class HostSsh:
    """How the coordinator's host logs in to one other host (what its `authorize` replied)."""

    user: str
    port: int
    host_keys: tuple[str, ...]  # "TYPE BASE64"; none: trusted as first seen (the host has no ssh-keyscan)


def address_of(hp: HostPlan) -> str:
    """Where the other hosts reach this one: its tasks' address (a spare's resolved address)."""
    return hp.tasks[0].addr_host if hp.tasks else default_address(hp.spec)


def ssh_files(run: str) -> tuple[str, str, str]:
    """The run's key, ssh_config and known_hosts, below the run's directory `run`."""
    ssh = posixpath.join(run, DetachedLayout.SSH)
    return posixpath.join(ssh, "key"), posixpath.join(ssh, "config"), posixpath.join(ssh, "known_hosts")


def ssh_config(plan: Plan, here: str, run: str, hosts: Mapping[str, HostSsh]) -> str:
    """The run's ssh_config: one block per host reached over SSH (`hosts`), nothing inherited."""
    key, _, known = ssh_files(run)
    blocks = []
    for hp in (*plan.hosts, *plan.spares, *plan.retired):
        ssh = hosts.get(hp.name)
        if hp.name == here or ssh is None:
            continue
        checking = "yes" if ssh.host_keys else "accept-new"
        blocks.append(f"Host {hp.name}\n  HostName {address_of(hp)}\n  Port {ssh.port}\n  User {ssh.user}\n"
                      f"  IdentityFile {key}\n  IdentitiesOnly yes\n  IdentityAgent none\n"
                      f"  HostKeyAlias dtf-{hp.name}\n  UserKnownHostsFile {known}\n"
                      f"  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking {checking}\n"
                      f"  BatchMode yes\n  PasswordAuthentication no\n  ForwardAgent no\n")
    return "\n".join(blocks)


def known_hosts(hosts: Mapping[str, HostSsh]) -> str:
    return "".join(f"dtf-{name} {key}\n" for name, ssh in sorted(hosts.items()) for key in ssh.host_keys)


def _seen_from(hp: HostPlan, here: str) -> HostPlan:
    spec = hp.spec
    if hp.name == here:
        spec = dataclasses.replace(spec, connection="local")
    elif spec.over_ssh:  # the run's ssh_config says how: nothing of the laptop's
        spec = dataclasses.replace(spec, user=None, port=None, identity_file=None)
    return dataclasses.replace(hp, spec=spec)


def vantage(record: Record, here: str, run: str) -> Record:
    """`record` (the laptop's) as the coordinator on host `here` uses it; `run`: the run's
    directory there (absolute)."""
    plan = record.plan
    allocation = plan.allocation
    if allocation is not None:  # Slurm: this node stands where the login host stood
        # ...and inside the job: never dtf's to replace from here (`submitted` off). A new
        # allocation after the job ended (a lost node) starts by cancelling what is left of the
        # old one, which would end this coordinator before it said why.
        allocation = dataclasses.replace(allocation, submitted=False,
                                         login=dataclasses.replace(allocation.login, connection="local"))
    ssh = any(hp.spec.over_ssh and hp.name != here for hp in (*plan.hosts, *plan.spares))
    seen = dataclasses.replace(
        plan, hosts=tuple(_seen_from(hp, here) for hp in plan.hosts),
        spares=tuple(_seen_from(hp, here) for hp in plan.spares),
        retired=tuple(_seen_from(hp, here) for hp in plan.retired),
        allocation=allocation, network="direct", ssh_config=ssh_files(run)[1] if ssh else None,
        ssh_config_line=0, ssh_config_column=0).with_firewalls()
    chief = next(hp for hp in plan.hosts if hp.name == here)
    return record.replace(plan=seen, chief_host=address_of(chief), network="direct", tf_ports_open=True,
                          taking_down=False, detached=None, coordinator=here)


def coordinator_host(plan: Plan) -> HostPlan:
    """Where a detached run's coordinator runs: the inventory's `coordinator:`, else the first host
    with a ps task (the ps hosts do the least of the training's work), else the first host."""
    if plan.coordinator is not None:
        chosen = next((hp for hp in plan.hosts if hp.name == plan.coordinator), None)
        if chosen is not None:
            return chosen
    return next((hp for hp in plan.hosts if any(t.job == "ps" for t in hp.tasks)), plan.hosts[0])
