"""The allocation a cluster's hosts belong to, where a scheduler lends them (a Slurm job): its id,
whether dtf made it, the host in front of it (the login host dtf reaches), its nodes and their
addresses, and what it was made from. Plain data in the plan (`Plan.allocation`); the provider that
made it (dtf.providers) is the only reader of its meaning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtf.cluster.inventory import HostSpec


@dataclass(frozen=True)
class Allocation:
    """A running job of a scheduler (Slurm) that holds a cluster's nodes, reached through its login host."""

    job: str
    submitted: bool  # dtf submitted it (and cancels it at `down`); False: the inventory's `job:`
    login: HostSpec  # the host in front of the nodes, the one dtf reaches
    nodes: tuple[str, ...] = ()  # in the scheduler's order
    addresses: tuple[str, ...] = ()  # each node's address (Slurm's NodeAddr): where the other tasks reach its servers
    request: tuple[str, ...] = ()  # what it was made from (its submit command): an `up` asking otherwise differs

    def address_of(self, node: str) -> str:
        return self.addresses[self.nodes.index(node)]

    def address_of_spec(self, spec: HostSpec) -> str:
        """A node's address, as the plan resolves a host's (`make_plan`'s resolve)."""
        return self.address_of(spec.host)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Allocation:
        login = dict(data["login"])
        for key in ("ps_ports", "worker_ports", "packages"):
            login[key] = tuple(login.get(key, ()))
        return cls(job=data["job"], submitted=data["submitted"], login=HostSpec(**login),
                   nodes=tuple(data["nodes"]), addresses=tuple(data["addresses"]),
                   request=tuple(data.get("request", ())))
