"""Sending packs (dtf.files.sync) to the hosts of a plan: one cheap check per pack and host, and
the bytes only where a host lacks them."""

from __future__ import annotations

from collections.abc import Sequence

from dtf.cluster.plan import HostPlan, Plan
from dtf.files.sync import HostSynced, Meter, Pack, Report, SyncError, megabytes
from dtf.hostops.launcher import ask, decode
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hosts.transport import HostError
from dtf_server.protocol import SyncReply


def sync_host(ops: HostOps, hp: HostPlan, packs: Sequence[Pack]) -> HostSynced:
    """Make sure the host holds every pack below WORKDIR/.cache/sync: one check each, and the
    bytes (streamed to the launcher, which checks their hash) only where one is missing."""
    sent: dict[str, int] = {}
    ops.step(hp, "connecting")
    with ops.transport(hp) as t:
        for p in packs:
            ops.step(hp, f"checking {p.name} ({p.synced.short})")
            have = ask(t, hp, SyncReply, hp.sync_argv(p.digest), f"checking {p.name}", 30)
            if have.present:
                sent[p.name] = 0
                continue
            ops.step(hp, f"sending {p.name}: {megabytes(p.bytes)}")
            meter = Meter(lambda step: ops.step(hp, step), p.name, p.bytes)
            try:
                with p.open() as f:
                    result = t.feed(hp.sync_argv(p.digest, receive=True), f, sent=meter)
            except SyncError as e:  # a file vanished or shrank since it was hashed
                raise HostError(f"sending {p.name}: {e}")
            reply = decode(SyncReply, result, f"sending {p.name}")
            if not reply.present:
                raise HostError(f"sending {p.name}: the host did not keep it")
            sent[p.name] = reply.received
    return HostSynced(sent)


def reports(packs: Sequence[Pack], outcomes: dict[str, Outcome[HostSynced]]) -> list[Report]:
    """Per pack, what each host got (every outcome succeeded)."""
    return [Report(p.synced, {h: o.value.sent[p.name] for h, o in outcomes.items()},
                   {h: o.seconds for h, o in outcomes.items()}) for p in packs]


def send(ops: HostOps, packs: Sequence[Pack], hosts: Sequence[HostPlan] | None = None
         ) -> dict[str, Outcome[HostSynced]]:
    """Make sure every host of the plan (or those given) holds every pack, all hosts in parallel:
    one cheap check per pack, and the bytes only where it is missing (`sync_host`)."""
    return ops.each_host(lambda hp: sync_host(ops, hp, packs), hosts)


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
