"""The provider of an inventory's own hosts: SSH hosts (OpenSSH or paramiko, dtf.hosts.connections)
and `connection: local` ones. They never end: the cluster lasts until `dtf down`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtf.cluster.plan import HostPlan
from dtf.hosts.base import CommandRunner
from dtf.providers.provider import Provider

if TYPE_CHECKING:
    from dtf.hosts.tunnel import Tunnel


class HostsProvider(Provider):
    def runner(self, hp: HostPlan) -> CommandRunner:
        return self.connections.runner(hp.spec, hp.ttl)

    def converses(self, hosts: Sequence[HostPlan]) -> bool:
        return all(self.connections.converses(hp.spec) for hp in hosts)

    def tunnel(self) -> Tunnel:
        remote = self.plan.remote_hosts
        return self.connections.tunnel([(hp.spec, [t.address for t in hp.tasks]) for hp in remote],
                                       {hp.name: hp.ttl for hp in remote})
