"""Wheels from host to host during one `dtf up`: the laptop's uplink carries a target's wheels
once, not once per host.

The first managed host of a target (platform and python) that needs wheels is the seed: the
laptop sends them there, and the seed serves them (`serve-wheels`, a stdlib HTTP server of the
launcher) on one of its planned TF ports, still free since its servers have not started. The
other hosts of that target wait for the seed, copy from it over the cluster's network (the
hosts reach each other on the TF ports: `up` requires it), check each file's sha256, and get
what they could not copy from the laptop instead. The seed's server stops once no request came
for SERVE_IDLE seconds; the seed starts its own servers on that port only after.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

SEED_WAIT = 900.0  # seconds a host waits for the seed to have the wheels, then the laptop sends
SERVE_IDLE = 10.0  # seconds without a request after which the seed's server stops
SERVE_LIMIT = 900.0  # seconds the seed's server runs at most


@dataclass
class Seed:
    host: str
    url: str | None = None  # where it serves, once it does
    ready: threading.Event = field(default_factory=threading.Event)  # it serves, or it failed
    closed: threading.Event = field(default_factory=threading.Event)  # its server stopped
    thread: threading.Thread | None = None


class Relay:
    """One seed per target; thread-safe."""

    def __init__(self) -> None:
        self._seeds: dict[str, Seed] = {}
        self._lock = threading.Lock()

    def join(self, target: str, host: str) -> Seed:
        """The seed of `target`: this host (the first to ask) or the one that asked first."""
        with self._lock:
            return self._seeds.setdefault(target, Seed(host))
