"""Sending packs (dtf.files.sync) to the hosts of a plan: one cheap check per pack and host, and
the bytes only where a host lacks them, over the laptop's uplink once.

The hosts that lack a pack and are reached over SSH form a tree (dtf.files.relay.tree, at most
SYNC_FANOUT children per host): the laptop streams the pack to the root, and every host passes
what it receives on to its children as it arrives, over the hosts' own network (the launcher's
`sync --from/--serve`, dtf_server.receive), each checking the hash of what it received. A host
that could not get it that way (its parent failed or was cut off, the hosts do not reach each
other on the relay's port) is then sent the pack by the laptop directly; local
hosts, and a lone host, are always sent it directly. Only a host the laptop could not send it to
either fails, named with its reason.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dtf.cluster.plan import HostPlan, Plan
from dtf.files import relay
from dtf.files.sync import HostSynced, Meter, Pack, Report, SyncError, megabytes
from dtf.hostops.launcher import ask, decode
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hosts.base import COMMAND_TIMEOUT, HostError
from dtf_server.protocol import Defaults, SyncReply

WAIT_ENV = "DTF_SYNC_RELAY_WAIT"  # seconds hosts wait for each other in the tree (default Defaults.RELAY_WAIT)


def relay_wait() -> float:
    """How long a host waits for its parent to listen, or for its children to connect: a firewall
    between the hosts costs this much before the laptop sends to them instead."""
    text = os.environ.get(WAIT_ENV, "")
    try:
        wait = float(text) if text else Defaults.RELAY_WAIT
    except ValueError:
        wait = -1
    if not 0 < wait <= 3600:
        raise SyncError(f"{WAIT_ENV}: expected seconds (0 < S <= 3600), got {text!r}")
    return wait


@dataclass(frozen=True)
class Checked:
    """What one host holds: per pack name, whether it has it; and a port free there (0: none)."""

    have: dict[str, bool]
    port: int


def check_host(ops: HostOps, hp: HostPlan, packs: Sequence[Pack]) -> Checked:
    """One short command per pack: does the host hold it (and a port it could relay from)."""
    have: dict[str, bool] = {}
    port = 0
    ops.step(hp, "connecting")
    with ops.runner(hp) as t:
        for p in packs:
            ops.step(hp, f"checking {p.name} ({p.synced.short})")
            reply = ask(t, hp, SyncReply, hp.sync_argv(p.digest, free_port=True), f"checking {p.name}", 30)
            have[p.name] = reply.present
            port = port or reply.port
    return Checked(have, port)


def send_direct(ops: HostOps, hp: HostPlan, p: Pack) -> int:
    """The laptop streams the pack to the host (the launcher checks its hash): the bytes it took."""
    ops.step(hp, f"sending {p.name}: {megabytes(p.bytes)}")
    meter = Meter(lambda step: ops.step(hp, step), p.name, p.bytes)
    with ops.runner(hp) as t:
        try:
            with p.open() as f:
                result = t.feed(hp.sync_argv(p.digest, receive=True), f, sent=meter)
        except SyncError as e:  # a file vanished or shrank since it was hashed
            raise HostError(f"sending {p.name}: {e}")
    reply = decode(SyncReply, result, f"sending {p.name}")
    if not reply.present:
        raise HostError(f"sending {p.name}: the host did not keep it")
    return reply.received


@dataclass(frozen=True)
class Tree:
    """One pack's way down the hosts: each host's parent (None: the laptop), and where each
    host relays from (its address and free port), with the token its children present."""

    parents: dict[str, str | None]
    relays: dict[str, str]  # host -> ADDR:PORT
    token: str
    wait: float = Defaults.RELAY_WAIT  # seconds a host waits for its parent, or its children


def plan_tree(hosts: Sequence[HostPlan], ports: dict[str, int], fanout: int = relay.SYNC_FANOUT,
              wait: float = Defaults.RELAY_WAIT) -> Tree:
    """A tree over the hosts that can take part: reached over SSH (or Slurm nodes, through job
    steps: they reach each other at their NodeAddr as their tasks do), with a free port, at the
    address their tasks have in the plan (the one `up` checked every other host reaches); the
    others are left out (sent directly)."""
    members = [hp for hp in hosts if not hp.spec.local and hp.tasks and ports.get(hp.name)]
    if len(members) < 2:
        return Tree({}, {}, "")
    return Tree(relay.tree([hp.name for hp in members], fanout),
                {hp.name: f"{hp.tasks[0].addr_host}:{ports[hp.name]}" for hp in members}, secrets.token_hex(16),
                wait)


def send_in_tree(ops: HostOps, hp: HostPlan, p: Pack, tree: Tree) -> int:
    """This host's part of the tree: receive the pack from its parent (the root: from the
    laptop) and pass it on to its children as it arrives. The bytes it received."""
    parent = tree.parents[hp.name]
    kids = relay.children(tree.parents, hp.name)
    port = int(tree.relays[hp.name].rpartition(":")[2]) if kids else 0
    argv = hp.sync_argv(p.digest, receive=True, source=tree.relays[parent] if parent else "", serve=port,
                        children=len(kids), token=tree.token, wait=tree.wait)
    passing = f", passing it on to {', '.join(kids)}" if kids else ""
    with ops.runner(hp) as t:
        if parent is None:
            ops.step(hp, f"sending {p.name}: {megabytes(p.bytes)}{passing}")
            meter = Meter(lambda step: ops.step(hp, step + passing), p.name, p.bytes)
            try:
                with p.open() as f:
                    # The root first waits for its children (Defaults.RELAY_WAIT), then goes at their pace.
                    result = t.feed(argv, f, stall=Defaults.RELAY_STALL + tree.wait + COMMAND_TIMEOUT, sent=meter)
            except SyncError as e:
                raise HostError(f"sending {p.name}: {e}")
        else:
            ops.step(hp, f"copying {p.name} from {parent}: {megabytes(p.bytes)}{passing}")
            # Bounded by the launcher's own deadlines (connect, accept, a stall on the stream);
            # this is the outer bound, for 1 MB/s or more.
            result = t.run(argv, timeout=2 * tree.wait + Defaults.RELAY_STALL + p.bytes / 1e6)
    reply = decode(SyncReply, result, f"copying {p.name} from {parent}" if parent else f"sending {p.name}")
    if not reply.present:
        raise HostError(f"receiving {p.name}: the host did not keep it")
    return reply.received


def reports(packs: Sequence[Pack], outcomes: dict[str, Outcome[HostSynced]]) -> list[Report]:
    """Per pack, what each host got (every outcome succeeded)."""
    return [Report(p.synced, {h: o.value.sent[p.name] for h, o in outcomes.items()},
                   {h: o.value.seconds.get(p.name, o.seconds) for h, o in outcomes.items()},
                   {h: o.value.via.get(p.name, "") for h, o in outcomes.items()}) for p in packs]


def send(ops: HostOps, packs: Sequence[Pack], hosts: Sequence[HostPlan] | None = None
         ) -> dict[str, Outcome[HostSynced]]:
    """Make sure every host of the plan (or those given) holds every pack: one cheap check per
    pack and host, all hosts in parallel; then per pack, the hosts that lack it get it through
    the tree (the laptop sends it once), and those the tree did not reach from the laptop."""
    hosts = list(ops.plan.hosts if hosts is None else hosts)
    wait = relay_wait()
    t0 = time.monotonic()
    checked = ops.each_host(lambda hp: check_host(ops, hp, packs), hosts)
    failed = {h: o.reason for h, o in checked.items() if not o.ok}
    sent: dict[str, dict[str, int]] = {hp.name: {} for hp in hosts}
    via: dict[str, dict[str, str]] = {hp.name: {} for hp in hosts}
    seconds: dict[str, dict[str, float]] = {hp.name: {} for hp in hosts}
    ports = {h: o.value.port for h, o in checked.items() if o.ok}
    for p in packs:
        if ops.cancel.is_set():
            break
        good = [hp for hp in hosts if hp.name not in failed]
        for hp in good:
            if checked[hp.name].value.have[p.name]:
                sent[hp.name][p.name], seconds[hp.name][p.name] = 0, 0.0
        lacking = [hp for hp in good if not checked[hp.name].value.have[p.name]]
        tree = plan_tree(lacking, ports, wait=wait)

        def first(hp: HostPlan, p: Pack = p, tree: Tree = tree) -> int:
            return send_in_tree(ops, hp, p, tree) if hp.name in tree.parents else send_direct(ops, hp, p)

        outcomes = ops.each_host(first, lacking)
        for hp in lacking:
            o = outcomes[hp.name]
            if o.ok:
                sent[hp.name][p.name], seconds[hp.name][p.name] = o.value, o.seconds
                via[hp.name][p.name] = tree.parents.get(hp.name) or ""
        # What the tree did not bring: the laptop sends it (a host failing here fails).
        again = [hp for hp in lacking if not outcomes[hp.name].ok and hp.name in tree.parents
                 and not ops.cancel.is_set()]
        for hp in again:
            ops.progress(hp.name, f"{outcomes[hp.name].reason}: sending from here")
        def direct(hp: HostPlan, p: Pack = p) -> int:
            return send_direct(ops, hp, p)

        retried = ops.each_host(direct, again)
        for hp in lacking:
            o = retried.get(hp.name) or outcomes[hp.name]
            if o.ok:
                sent[hp.name][p.name], seconds[hp.name][p.name] = o.value, o.seconds
            else:
                failed[hp.name] = o.reason
    total = time.monotonic() - t0
    return {hp.name: (Outcome(hp.name, False, reason=failed[hp.name], seconds=total) if hp.name in failed
                      else Outcome(hp.name, True, data=HostSynced(sent[hp.name], via[hp.name], seconds[hp.name]),
                                   seconds=total))
            for hp in hosts}


def hosts_of(plan: Plan) -> list[HostPlan]:
    """One host per place a tree lands: local entries sharing a workdir are one machine's one cache."""
    seen: set[tuple[str, str]] = set()
    out = []
    for hp in plan.hosts:
        key = ("local", hp.spec.workdir) if hp.spec.local else (hp.name.lower(), hp.spec.workdir)
        if key not in seen:
            seen.add(key)
            out.append(hp)
    return out
