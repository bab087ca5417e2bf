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
from pathlib import Path

from dtf.cluster import state
from dtf.cluster.state import Record
from dtf.errors import ClusterDown, DtfError
from dtf.hostops.parallel import HostOps, no_view

Say = Callable[[str], None]
SLURM_WAIT = 600.0  # seconds a new allocation may pend (`dtf train --slurm-wait`), as `dtf up`'s
JOB_POLL = 2.0  # seconds between two looks at the job while `dtf train` waits for its tasks


def replaceable(record: Record) -> bool:
    """Whether dtf may replace the cluster's Slurm job: one it submitted itself."""
    return record.plan.slurm is not None and record.plan.slurm.submitted


def refusal(record: Record, ended: str, attempt: int, attempts: int) -> str | None:
    """The one line `dtf train` ends with instead of a new allocation (None: one may be made)."""
    cluster = record.plan.cluster
    if not replaceable(record):
        return f"cluster {cluster!r}: {ended}"
    if attempt >= attempts:
        return f"cluster {cluster!r}: {ended}; no attempts left (--attempts {attempts})"
    return None


def comeback(record: Record, ended: str, *, wait: float, connect_timeout: float, say: Say) -> Record:
    """Replace the ended job of `record`'s cluster (`ended`: why it ended, one line) with a new
    allocation from the same inventory and start every task on it; the new record. ClusterDown
    (one line, naming the job) when the inventory asks for another allocation now, when the new
    one pends past `wait` seconds, or when its tasks do not start (it is cancelled then)."""
    from dtf.cluster import slurm
    from dtf.cluster.inventory import load as load_inventory
    from dtf.files import sync
    from dtf.hostops import lifecycle
    from dtf.hostops import slurm as slurm_ops

    plan = record.plan
    old = plan.slurm
    assert old is not None and old.submitted
    cluster = plan.cluster
    path = Path(record.inventory)
    try:
        inv = load_inventory(path)
    except DtfError as e:
        raise ClusterDown(f"cluster {cluster!r}: {ended}; its inventory cannot be read again for a new "
                          f"allocation: {' '.join(x.strip() for x in e.lines())}")
    if inv.slurm is None or slurm.request(inv) != old.request:
        raise ClusterDown(f"cluster {cluster!r}: {ended}; its inventory {path} now asks for another "
                          f"allocation than job {old.job}'s: run `dtf up {path}` for it")
    t0 = time.monotonic()
    say(f"{ended}; asking Slurm for a new allocation (up to {wait:g}s)")
    server = plan.hosts[0].server if plan.hosts else "tensorflow"
    network = None if plan.network == "auto" else plan.network
    try:
        if slurm_ops.cancel_ended(old, cluster, plan.ssh_config, plan.ttl, connect_timeout):
            say(f"job {old.job} cancelled (what was left of it)")
        with state.locked():  # the cluster's record and connections go with the job
            HostOps(plan).close_control()
            slurm_ops.close_masters(cluster)
            state.remove(cluster)
        with lifecycle.allocated(inv, path, wait=wait, say=say, connect_timeout=connect_timeout,
                                 ttl=plan.ttl) as allocation:
            new_plan = lifecycle.load_plan(path, plan.ttl, server, network=network, slurm=allocation, inv=inv,
                                           config_checked=True)
            with sync.packed([(item.name, item.path) for item in new_plan.sync]) as packs:
                result = lifecycle.up(new_plan, path, ttl=plan.ttl, replace=True, connect_timeout=connect_timeout,
                                      view=no_view, packs=packs)
    except DtfError as e:
        lines = [x.strip() for line in e.lines() for x in line.splitlines() if x.strip()] or [type(e).__name__]
        raise ClusterDown(f"cluster {cluster!r}: {ended}; no new allocation: {' '.join(lines)} "
                          f"(`dtf up` starts the cluster anew)")
    job = result.record.plan.slurm
    assert job is not None
    # `created` stays: the same cluster to the watch for `dtf down` (dtf.program.train.taken_down).
    new = result.record.replace(allocation=record.allocation + 1, created=record.created,
                                replaced=[*record.replaced, f"{old.job}: {ended}"])
    with state.locked():
        state.save(new)
    say(f"job {job.job} replaces job {old.job} (allocation {new.allocation} of cluster {cluster}): "
        f"its tasks serve on {', '.join(job.nodes)} after {time.monotonic() - t0:.1f}s")
    return new


class JobWatch:
    """While `dtf train` waits for its tasks to serve again: whether the cluster's Slurm job has
    ended meanwhile (asked every JOB_POLL s; never, for a cluster of hosts). `ended` holds the line."""

    def __init__(self, record: Record, connect_timeout: float,
                 job_ended: Callable[[Record, float], str | None]) -> None:
        self.record, self.connect_timeout, self.job_ended = record, connect_timeout, job_ended
        self.ended: str | None = None
        self.last = time.monotonic()

    def __call__(self) -> bool:
        if self.record.plan.slurm is None or time.monotonic() - self.last < JOB_POLL:
            return self.ended is not None
        self.last = time.monotonic()
        self.ended = self.job_ended(self.record, self.connect_timeout)
        return self.ended is not None
