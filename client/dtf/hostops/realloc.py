"""A Slurm cluster whose job ended under `dtf train` (a lost node, a preemption, the time limit),
brought back: what is left of the job is cancelled, a new allocation is asked for from the same
inventory (as `dtf up` asks: `salloc --no-shell`, its wait bounded by `wait` seconds), the tasks
are started on its nodes, and the cluster's record names the new job, which allocation of the
cluster it is and the jobs it replaced. The program's next attempt then resumes from its last
checkpoint (dtf.program.train).

A job of the user's own (the inventory's `job:`) is never replaced: dtf did not make it, and
cannot make its like. Nothing here prints: what the wait looks like goes through `say`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dtf.cluster.inventory import Inventory
from dtf.cluster.state import Record
from dtf.hostops.parallel import no_view
from dtf.providers.choose import provider_for

Say = Callable[[str], None]
ALLOCATION_WAIT = 600.0  # seconds a new allocation may pend (`dtf train --slurm-wait`), as `dtf up`'s
JOB_POLL = 2.0  # seconds between two looks at the job while `dtf train` waits for its tasks


def replaceable(record: Record) -> bool:
    """Whether dtf may replace the cluster's allocation when it ends: one it made itself."""
    return provider_for(record.plan).replaceable()


def refusal(record: Record, ended: str, attempt: int, attempts: int) -> str | None:
    """The one line `dtf train` ends with instead of a new allocation (None: one may be made)."""
    cluster = record.plan.cluster
    if not replaceable(record):
        return f"cluster {cluster!r}: {ended}"
    if attempt >= attempts:
        return f"cluster {cluster!r}: {ended}; no attempts left (--attempts {attempts})"
    return None


def comeback(record: Record, ended: str, *, wait: float, connect_timeout: float, say: Say) -> Record:
    """Replace the ended allocation of `record`'s cluster (`ended`: why it ended, one line) with a
    new one from the same inventory and start every task on it, as `dtf up --replace` would; the
    new record (its provider says what it does: dtf.providers.slurm.reallocate). ClusterDown (one
    line) when no new allocation can be had or its tasks do not start."""
    from dtf.files import sync
    from dtf.hostops import lifecycle

    def start_anew(inv: Inventory, ttl: float, server: str, network: str | None) -> Record:
        with lifecycle.allocated(inv, wait=wait, say=say, connect_timeout=connect_timeout, ttl=ttl) as allocation:
            plan = lifecycle.load_plan(inv, ttl, server, network=network, allocation=allocation)
            with sync.packed([(item.name, item.path) for item in plan.sync]) as packs:
                return lifecycle.up(plan, ttl=ttl, replace=True, connect_timeout=connect_timeout, view=no_view,
                                    packs=packs).record

    return provider_for(record.plan, connect_timeout).reallocate(record, ended, wait=wait, say=say,
                                                                 start_anew=start_anew)


class JobWatch:
    """While `dtf train` waits for its tasks to serve again: whether the cluster's Slurm job has
    ended meanwhile (asked every JOB_POLL s; never, for a cluster of hosts). `ended` holds the line."""

    def __init__(self, record: Record, connect_timeout: float,
                 job_ended: Callable[[Record, float], str | None]) -> None:
        self.record, self.connect_timeout, self.job_ended = record, connect_timeout, job_ended
        self.ended: str | None = None
        self.last = time.monotonic()
        self.ends = provider_for(record.plan, connect_timeout).ends

    def __call__(self) -> bool:
        if not self.ends or time.monotonic() - self.last < JOB_POLL:
            return self.ended is not None
        self.last = time.monotonic()
        self.ended = self.job_ended(self.record, self.connect_timeout)
        return self.ended is not None
