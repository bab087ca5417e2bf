"""From host to host: the laptop's uplink carries the bytes once, not once per host, and no host
serves more than a few others (a tree over the hosts, `tree()`).

`dtf sync` (dtf.hostops.syncing): the laptop streams a pack to the tree's root; every host passes
what it receives on to its children as it arrives (dtf_server.receive.Relay), so the pack flows
down the tree as a pipeline and the time grows with its depth, not with the host count.

Wheels from host to host during one `dtf up`: the laptop's uplink carries a target's wheels
once, not once per host.

The first managed host of a target (platform and python) that needs wheels is the seed: the
laptop sends them there, and the seed serves them (`serve-wheels`, a stdlib HTTP server of the
launcher) on one of its planned TF ports, still free since its servers have not started. The
other hosts of that target join in turn, each under a parent that joined before it (`tree()`,
at most WHEEL_FANOUT children per host): they wait for their parent to have the wheels, copy
from it over the cluster's network (the hosts reach each other on the TF ports: `up` requires
it), check each file's sha256, get what they could not copy from the laptop instead, and then
serve them in turn to their own children. A host's server stops once no request came for
SERVE_IDLE seconds; it starts its own servers on that port only after.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

SEED_WAIT = 900.0  # seconds a host waits for the seed to have the wheels, then the laptop sends
SERVE_IDLE = 10.0  # seconds without a request after which the seed's server stops
SERVE_LIMIT = 900.0  # seconds the seed's server runs at most
SYNC_FANOUT = 2  # hosts each host passes a `dtf sync` pack on to (streamed: the depth costs little)
WHEEL_FANOUT = 4  # hosts each host serves the wheels to (copied whole: a shallower tree)


def tree(hosts: Sequence[str], fanout: int) -> dict[str, str | None]:
    """Each host's parent in a tree over `hosts`, in their order: the first is the root (None:
    the laptop sends to it), host i copies from host (i - 1) // fanout, so none serves more than
    `fanout` others and the depth is about log(len(hosts), fanout)."""
    assert fanout >= 1
    return {h: (hosts[(i - 1) // fanout] if i else None) for i, h in enumerate(hosts)}


def children(parents: dict[str, str | None], host: str) -> list[str]:
    """The hosts that copy from `host` in a `tree()`."""
    return [h for h, p in parents.items() if p == host]


@dataclass
class Seed:
    """A host of a target's tree: once it has the wheels it serves them to the hosts that joined
    under it (`parent` None: the laptop sends to it)."""

    host: str
    parent: Seed | None = None
    url: str | None = None  # where it serves, once it does
    ready: threading.Event = field(default_factory=threading.Event)  # it serves, or it failed
    closed: threading.Event = field(default_factory=threading.Event)  # its server stopped
    thread: threading.Thread | None = None


class Relay:
    """One tree of hosts per target, grown as hosts join (WHEEL_FANOUT children at most per
    host); thread-safe."""

    def __init__(self, fanout: int = WHEEL_FANOUT) -> None:
        self._trees: dict[str, list[Seed]] = {}
        self._lock = threading.Lock()
        self.fanout = fanout

    def join(self, target: str, host: str) -> Seed:
        """This host's place in the tree of `target`: the first to join is the root (the seed,
        the laptop sends to it); the others copy from their parent (`Seed.parent`)."""
        with self._lock:
            nodes = self._trees.setdefault(target, [])
            for node in nodes:
                if node.host == host:
                    return node
            parent = tree([*(n.host for n in nodes), host], self.fanout)[host]
            node = Seed(host, parent=next((n for n in nodes if n.host == parent), None))
            nodes.append(node)
            return node
