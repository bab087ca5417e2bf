"""The one way dtf acts on every host of a plan at once: `HostOps.each_host` runs a function on
each host in its own thread, with its own connection and a deadline on every step, and returns
one `Outcome` per host (Fabric's GroupResult habit); `failures` and `require_all` turn them into
one combined HostFailure listing every host that failed. Starting, sending packs, environments,
status, stopping and collective mode all go through it.

Nothing here prints: progress goes through a callback, so the CLI decides how it looks.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, TypeVar

from dtf.cluster.plan import HostPlan, Plan
from dtf.errors import HostFailure
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.providers.choose import provider_for

Progress = Callable[[str, str], None]  # (host, what it is doing now)
# (hosts, title) -> a context manager yielding the per-host progress callback (the CLI's live table).
ProgressView = Callable[[list[str], str], AbstractContextManager[Progress]]

T = TypeVar("T")

# Hosts at once in the steps of many hosts where a host waits for nothing but itself (`up`'s start,
# status, stop...); DTF_TURNS changes it.
AT_ONCE = 32


@dataclass
class Outcome(Generic[T]):
    host: str
    ok: bool
    reason: str = ""
    data: T | None = None
    seconds: float = 0.0

    @property
    def value(self) -> T:
        """The data of a host that succeeded."""
        assert self.ok and self.data is not None, self
        return self.data


def failures(outcomes: dict[str, Outcome[T]]) -> dict[str, str]:
    """The hosts that failed, with the reason."""
    return {h: o.reason for h, o in outcomes.items() if not o.ok}


def require_all(action: str, outcomes: dict[str, Outcome[T]]) -> dict[str, Outcome[T]]:
    """The outcomes, when every host succeeded; else one HostFailure naming every host that failed."""
    failed = failures(outcomes)
    if failed:
        raise HostFailure(action, failed)
    return outcomes


class Cancelled(Exception):
    pass


def no_progress(host: str, step: str) -> None:
    pass


@contextlib.contextmanager
def no_view(hosts: list[str], title: str) -> Iterator[Progress]:
    yield no_progress


class HostOps:
    """The hosts of one plan, and how to act on all of them at once. Each operation (dtf.hostops's
    start, syncing, status, stop...) takes one; `cancel` (Ctrl-C) stops every host at its next step."""

    def __init__(self, plan: Plan, progress: Progress = no_progress,
                 connect_timeout: float = CONNECT_TIMEOUT, view: ProgressView = no_view) -> None:
        self.plan = plan
        self.progress = progress
        self.connect_timeout = connect_timeout
        self.view = view
        self.cancel = threading.Event()
        self.provider = provider_for(plan, connect_timeout)

    @contextlib.contextmanager
    def shown(self, title: str, hosts: Sequence[HostPlan] | None = None) -> Iterator[None]:
        """While inside, the hosts' steps (all, or those given) show in `view` under `title`."""
        hosts = self.plan.hosts if hosts is None else hosts
        with self.view([hp.name for hp in hosts], title) as progress:
            before, self.progress = self.progress, progress
            try:
                yield
            finally:
                self.progress = before

    def runner(self, hp: HostPlan) -> CommandRunner:
        """The host's runner, as the plan's provider reaches it (dtf.providers)."""
        return self.provider.runner(hp)

    @staticmethod
    def at_once() -> int:
        """How many hosts at once the steps that wait for nothing but their host take (up's
        check-start and mesh check, status, the lease's renewal, stop and down): AT_ONCE, or
        DTF_TURNS."""
        value = os.environ.get("DTF_TURNS", "")
        return int(value) if value.isdigit() and int(value) > 0 else AT_ONCE

    def close_control(self) -> None:
        """Close the cluster's connections (`dtf down`, a failed `up`)."""
        self.provider.close()

    def each_host(self, fn: Callable[[HostPlan], T], hosts: Sequence[HostPlan] | None = None,
                  at_once: int | None = None) -> dict[str, Outcome[T]]:
        """Run fn on every host in parallel; a HostError on one host is that host's outcome.

        `at_once`: at most that many hosts at once, each from the moment its turn comes, so that
        every deadline of fn counts from there (only where no host waits for another: a host
        waiting for its turn would never come). Where the hosts share this machine's cores (local
        hosts, a test lab), 100 launchers started at once would each run past its own deadline."""
        hosts = self.plan.hosts if hosts is None else hosts

        def one(hp: HostPlan) -> Outcome[T]:
            t0 = time.monotonic()
            try:
                data = fn(hp)
                self.progress(hp.name, "done")
                return Outcome(hp.name, True, data=data, seconds=time.monotonic() - t0)
            except (HostError, Cancelled) as e:
                self.progress(hp.name, f"failed: {e}")
                return Outcome(hp.name, False, reason=str(e), seconds=time.monotonic() - t0)
            # Anything else is a bug, not the host's failure: it is raised once every host is done
            # (the CLI shows one line and logs the traceback), never shown as "host: KeyError".

        if not hosts:
            return {}
        at_once = min(len(hosts), at_once or len(hosts))
        with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="dtf-host") as pool:
            futures = {hp.name: pool.submit(one, hp) for hp in hosts}
            try:
                wait(futures.values())
            except KeyboardInterrupt:
                self.cancel.set()  # the threads stop at their next step; each step is bounded
                wait(futures.values())
        return {name: f.result() for name, f in futures.items()}  # raises the first bug

    def step(self, hp: HostPlan, what: str) -> None:
        """Report the host's next step; Cancelled if the operation was cancelled."""
        if self.cancel.is_set():
            raise Cancelled("interrupted")
        self.progress(hp.name, what)

    def hosts_in(self, only: dict[str, set[str]]) -> tuple[HostPlan, ...]:
        return tuple(hp for hp in self.plan.hosts if only.get(hp.name))
