"""A Slurm cluster whose job ended under `dtf train` (a lost node, a preemption, the time limit),
brought back: what is left of the job is cancelled, a new allocation is asked for from the same
inventory (as `dtf up` asks: `salloc --no-shell`, its wait bounded by `wait` seconds), the tasks
are started on its nodes (`start_anew`: dtf.hostops.realloc, as `dtf up --replace`), and the
cluster's record names the new job, which allocation of the cluster it is and the jobs it replaced.

A job of the user's own (the inventory's `job:`) is never replaced: dtf did not make it, and
cannot make its like. Nothing here prints: what the wait looks like goes through `say`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from dtf.cluster import state
from dtf.cluster.inventory import Inventory
from dtf.cluster.state import Record
from dtf.errors import ClusterDown, DtfError
from dtf.hosts.connections import Connections
from dtf.providers.slurm import allocation as slurm_ops
from dtf.providers.slurm import commands as slurm

Say = Callable[[str], None]
StartAnew = Callable[[Inventory, float, str, "str | None"], Record]


def comeback(record: Record, ended: str, *, wait: float, connect_timeout: float, say: Say,
             start_anew: StartAnew) -> Record:
    """Replace the ended job of `record`'s cluster (`ended`: why it ended, one line) with a new
    allocation from the same inventory and start every task on it (`start_anew(inventory, ttl,
    server, network)`: the new record); the new record, saved. ClusterDown (one line, naming the
    job) when the inventory asks for another allocation now, when the new one pends past `wait`
    seconds, or when its tasks do not start (it is cancelled then)."""
    from dtf.cluster.inventory import load as load_inventory

    plan = record.plan
    old = plan.allocation
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
            Connections(state.home(), cluster).close()
            state.remove(cluster)
        new = start_anew(inv, plan.ttl, server, network)
    except DtfError as e:
        lines = [x.strip() for line in e.lines() for x in line.splitlines() if x.strip()] or [type(e).__name__]
        raise ClusterDown(f"cluster {cluster!r}: {ended}; no new allocation: {' '.join(lines)} "
                          f"(`dtf up` starts the cluster anew)")
    job = new.plan.allocation
    assert job is not None
    # `created` stays: the same cluster to the watch for `dtf down` (dtf.program.train.taken_down).
    new = new.replace(allocation=record.allocation + 1, created=record.created,
                      replaced=[*record.replaced, f"{old.job}: {ended}"])
    with state.locked():
        state.save(new)
    say(f"job {job.job} replaces job {old.job} (allocation {new.allocation} of cluster {cluster}): "
        f"its tasks serve on {', '.join(job.nodes)} after {time.monotonic() - t0:.1f}s")
    return new
