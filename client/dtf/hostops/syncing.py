"""Sending packs (dtf.files.sync) to the hosts of a plan: one cheap check per pack and host, and
the bytes only where a host lacks them."""

from __future__ import annotations

from collections.abc import Sequence

from dtf.cluster.plan import HostPlan, Plan
from dtf.files.sync import HostSynced, Pack, Report
from dtf.hostops.ops import ClusterOps, Outcome


def reports(packs: Sequence[Pack], outcomes: dict[str, Outcome[HostSynced]]) -> list[Report]:
    """Per pack, what each host got (every outcome succeeded)."""
    return [Report(p.synced, {h: o.value.sent[p.name] for h, o in outcomes.items()},
                   {h: o.seconds for h, o in outcomes.items()}) for p in packs]


def send(ops: ClusterOps, packs: Sequence[Pack], hosts: Sequence[HostPlan] | None = None
         ) -> dict[str, Outcome[HostSynced]]:
    """Make sure every host of the plan (or those given) holds every pack, all hosts in parallel:
    one cheap check per pack, and the bytes only where it is missing (`ClusterOps.sync_host`)."""
    return ops.each_host(lambda hp: ops.sync_host(hp, packs), hosts)


def hosts_of(plan: Plan) -> list[HostPlan]:
    """One host per place a tree lands: local entries sharing a workdir are one machine's one cache."""
    seen: set[tuple[str, str]] = set()
    out = []
    for hp in plan.hosts:
        key = ("local", hp.spec.workdir) if hp.spec.connection == "local" else (hp.name.lower(), hp.spec.workdir)
        if key not in seen:
            seen.add(key)
            out.append(hp)
    return out
