"""The cluster's lease: each host's tasks stop themselves when no one renewed it for its ttl (a lost
laptop leaves nothing running). `renew` renews it on every host; `LeaseKeeper` renews it while a
long command runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dtf.cluster.plan import HostPlan, Plan
from dtf.hostops.launcher import RENEW_TIMEOUT, LauncherMissing, ask, root_exists
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf_server.protocol import RenewReply


def renew_host(ops: HostOps, hp: HostPlan, ttl: float | None = None) -> RenewReply:
    with ops.runner(hp) as t:
        try:
            return ask(t, hp, RenewReply, hp.renew_argv(ttl), "renewing the lease", RENEW_TIMEOUT,
                       upload_if=lambda: root_exists(t, hp))
        except LauncherMissing:
            return RenewReply(lease=None)  # the files are gone: nothing to renew


def renew(ops: HostOps, ttl: float | None = None) -> dict[str, Outcome[RenewReply]]:
    return ops.each_host(lambda hp: renew_host(ops, hp, ttl), at_once=ops.at_once())


class LeaseKeeper:
    """Renews the cluster's lease on every host while a long command (`dtf train`) runs.

    A renewal that fails (a host cut off) is retried at the next beat; `warn` is told once per
    host when its lease has gone unrenewed for half its ttl, since the tasks there will stop
    themselves when it lapses.
    """

    def __init__(self, plan: Plan, warn: Callable[[str], None], connect_timeout: float = CONNECT_TIMEOUT,
                 spares: bool = False):
        """`spares`: renew on the plan's spares too, saying nothing of them (a detached run's
        coordinator: its key there lasts as long as their lease, dtf_server.sshkeys)."""
        self.ops = HostOps(plan, connect_timeout=connect_timeout)
        self.spares = spares
        self.ttl = min((hp.ttl for hp in plan.hosts), default=0.0)
        self.interval = min(max(self.ttl / 4, 1.0), 60.0)
        self.warn = warn
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dtf-lease", daemon=True)
        self.renewed = {hp.name: time.monotonic() for hp in plan.hosts}
        self.warned: set[str] = set()

    def follow(self, plan: Plan) -> None:
        """Renew on the hosts of `plan` from now on (tasks moved to a spare: dtf.hostops.repair)."""
        self.ops = HostOps(plan, connect_timeout=self.ops.connect_timeout)
        now = time.monotonic()
        self.renewed = {hp.name: self.renewed.get(hp.name, now) for hp in plan.hosts}

    def __enter__(self) -> LeaseKeeper:
        if self.ttl > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=RENEW_TIMEOUT + self.ops.connect_timeout)

    @staticmethod
    def _renew_spares(ops: HostOps) -> None:
        ops.each_host(lambda hp: renew_host(ops, hp, hp.ttl), ops.plan.spares, at_once=ops.at_once())

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            if self.spares and self.ops.plan.spares:
                self._renew_spares(self.ops)
            for host, o in renew(self.ops).items():
                now = time.monotonic()
                if o.ok and o.value.lease is not None:
                    self.renewed[host] = now
                    self.warned.discard(host)
                elif now - self.renewed.get(host, now) > self.ttl / 2 and host not in self.warned:
                    self.warned.add(host)
                    why = "its tasks' files are gone" if o.ok else o.reason
                    self.warn(f"cannot renew the lease on {host} for {now - self.renewed[host]:.0f}s "
                              f"({why}); its tasks stop themselves if it lapses ({self.ttl:g}s)")
