"""The laptop's route to the tasks' TF ports: directly, or through SSH to their hosts (network:
ssh; the tunnel, dtf.hosts.tunnel, carries the training's connections), as the plan's network says
(`Plan.network_for`); `auto` decided by `up` from what it found (`decided_network`), and checked for
every task once its server serves (`check_reach`). The provider (dtf.providers.provider) asks it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.netutil import port_open, probe_all, wait_port

REACH_TIMEOUT = 15.0  # seconds the laptop gives a started server's port to accept a connection
# The direct probes of a host's TF ports (check_reach), in ssh and auto mode. A firewall that
# drops them never answers: they are not waited for to the end of their DIRECT_PROBE seconds.
DIRECT_PROBE = 2.0  # seconds one direct connection attempt gets
DIRECT_FIRST = 0.25  # seconds an SSH host's direct probes get before the probes through SSH go too
DIRECT_GRACE = 0.25  # seconds the direct probes get at least, from their start, once those through SSH answered
# A Slurm node's, shorter: a laptop rarely reaches a site's compute nodes, whose network most often
# drops its packets (bench/slurm_up.py --drop shows the cost). Taking a node that answers directly
# but late for dropped costs only the way through SSH.
SLURM_GRACE = 0.1


def through_ssh(plan: Plan, network: str, hp: HostPlan) -> bool:
    """Whether this machine reaches the host's tasks through SSH in the cluster's `network`
    (the record's, decided by `up`): local hosts' tasks always directly."""
    return network == "ssh" and not hp.spec.local


def decided_network(plan: Plan, direct: Mapping[str, bool]) -> str:
    """The mode `dtf train` uses: the plan's, or for auto, direct when this machine reached every
    remote host's tasks directly (`direct`: host -> whether it did), else ssh (`up` checked that SSH
    reaches them)."""
    if any(plan.network_for(hp) == "ssh" for hp in plan.remote_hosts):
        return "ssh"
    # In direct mode every host reported `direct` (or `up` failed); local hosts always do.
    return "direct" if all(direct[hp.name] for hp in plan.remote_hosts) else "ssh"


def network_line(plan: Plan) -> str:
    """What `up` will do about how this machine reaches the tasks (for --dry-run)."""
    if not plan.remote_hosts:
        return "network: direct (every host is this machine)"
    ports = ", ".join(t.address for hp in plan.remote_hosts for t in hp.tasks)
    if all(plan.network_for(hp) == "ssh" for hp in plan.remote_hosts):
        why = " (firewall: members)" if plan.network == "auto" else ""
        return (f"network: ssh{why}: `dtf train` reaches {ports} through SSH to their hosts; "
                f"`up` checks each through SSH, and whether this machine can also reach them directly")
    if plan.network == "direct":
        return f"network: direct: `up` checks that this machine connects to {ports}"
    return (f"network: auto: `up` tests whether this machine connects directly to {ports}; "
            f"if every one does, direct, else ssh (through SSH to their hosts, checked too)")


def laptop_let_in(plan: Plan) -> bool:
    """Whether a host's firewall rules let this machine in (some remote host reached directly)."""
    return any(plan.network_for(hp) != "ssh" for hp in plan.remote_hosts)


def check_reach(plan: Plan, t: CommandRunner, hp: HostPlan, tasks: Sequence[TaskPlan]) -> bool:
    """Check that this machine reaches every task as the plan's network says (HostError where it
    does not); whether the TF ports accept connections from here directly (also in ssh mode: `up`
    reports it)."""
    network = plan.network_for(hp)
    if network == "direct":
        deadline = time.monotonic() + REACH_TIMEOUT
        for task in tasks:
            if not wait_port(task.addr_host, task.port, deadline):
                raise HostError(f"{task.name} serves on its host but {task.address} is not "
                                f"reachable from this machine (firewall? wrong address? try network: ssh)")
        return True
    began = time.monotonic()
    found: list[bool] = []  # whether every task answered directly, once known

    def direct() -> bool:
        return bool(found) and found[0]

    probes = threading.Thread(target=lambda: found.append(all(probe_all(
        lambda task: port_open(task.addr_host, task.port, DIRECT_PROBE), tasks))), name="dtf-direct", daemon=True)
    probes.start()  # (probe_all's threads are daemons too: the exit never waits for them)
    # A compute node rarely takes this machine's connections: the probes through its login
    # host (its runner's front) go out at once, beside the direct ones. An SSH
    # host's go where the direct ones did not all answer yes within DIRECT_FIRST.
    if not t.through_front():
        probes.join(DIRECT_FIRST)
        if direct() and network == "auto":
            return True
    deadline = time.monotonic() + REACH_TIMEOUT
    pending = list(tasks)
    while True:  # every task at once, as the direct probes: a round trip each over the master
        through = time.monotonic()
        reached = probe_all(lambda task: t.reaches(task.address, timeout=min(5.0, REACH_TIMEOUT)), pending)
        pending = [task for task, ok in zip(pending, reached) if not ok]
        if not pending or (direct() and network == "auto"):
            # Direct probes that have not answered by now, given as long again as they have
            # had (that includes the probes through SSH, which cross the same network, and
            # more) and DIRECT_GRACE at least, are dropped: not slow. Else a site's firewall
            # that drops them would cost every `up` DIRECT_PROBE seconds. (As long again: a loaded
            # machine that is slow to run the direct probes' threads is as slow with the
            # others; a direct path taken for dropped is only slower, through SSH.) A Slurm
            # node's: as long again as the probes through its login host took, SLURM_GRACE
            # from their start at least.
            now = time.monotonic()
            if t.through_front():
                probes.join(max(0.0, began + SLURM_GRACE - now, now - through))
            else:
                probes.join(max(0.0, began + DIRECT_GRACE - now, now - began))
            return direct()
        if time.monotonic() > deadline:
            probes.join(DIRECT_PROBE + 5)
            if direct() and network == "auto":
                return True
            task = pending[0]
            raise HostError(f"{task.name} serves on its host but {task.address} is not reachable "
                            f"through SSH from this machine (does its sshd allow TCP forwarding?)"
                            + ("" if network == "ssh" else ", nor directly"))
        time.sleep(0.2)


def rides_ssh(network: str) -> bool:
    """Whether a record's network carries the training's connections through SSH (dtf.hosts.tunnel)."""
    return network == "ssh"


def direct_only(plan: Plan) -> bool:
    """Whether the inventory says `network: direct`: never through SSH, even where direct fails."""
    return plan.network == "direct"
