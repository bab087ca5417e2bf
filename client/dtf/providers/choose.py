"""Which provider a cluster has: the one place that asks whether its hosts are an inventory's own
or a Slurm allocation's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import Inventory
from dtf.cluster.plan import Plan
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.providers.provider import Provider, Say

if TYPE_CHECKING:
    from dtf.cluster.state import Record


def provider_for(plan: Plan, connect_timeout: float = CONNECT_TIMEOUT) -> Provider:
    """The provider of the plan's hosts (built, not connected)."""
    if plan.allocation is not None:
        from dtf.providers.slurm.provider import SlurmProvider

        return SlurmProvider(plan, connect_timeout)
    from dtf.providers.hosts import HostsProvider

    return HostsProvider(plan, connect_timeout)


@contextlib.contextmanager
def allocated(inv: Inventory, *, wait: float, say: Say, connect_timeout: float, replace: bool,
              ttl: float | None, take_down: Callable[[Record], None]) -> Iterator[Allocation | None]:
    """`up`'s hosts for the block that starts the cluster on them: the allocation of an inventory
    whose hosts a scheduler lends (dtf.providers.slurm.allocation.allocated: made now, or the
    recorded cluster's; released if the block raises), or None: the inventory's own hosts."""
    if inv.slurm is None:
        yield None
        return
    from dtf.providers.slurm.allocation import allocated as slurm_allocated

    with slurm_allocated(inv, wait=wait, say=say, connect_timeout=connect_timeout, replace=replace, ttl=ttl,
                         take_down=take_down) as allocation:
        yield allocation


def request_lines(inv: Inventory) -> list[str] | None:
    """What `up` asks a scheduler for, for --dry-run, where one lends the hosts (None: the
    inventory's own hosts, which `up` plans at once)."""
    if inv.slurm is None:
        return None
    from dtf.providers.slurm.commands import request_lines as slurm_request

    return slurm_request(inv)
