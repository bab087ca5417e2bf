"""dtf.detached.vantage without a lab: a Slurm cluster as its detached coordinator sees it from the
node it runs on (tests/slurm/test_slurm_detached.py: on the Slurm lab)."""

from __future__ import annotations

from dtf.detached import vantage
from dtf.hostops import realloc
from helpers import slurm_record


def test_a_slurm_node_stands_where_the_login_host_stood_and_never_replaces_its_own_job() -> None:
    laptop = slurm_record()
    seen = vantage.vantage(laptop, "n1", "/home/u/.dtf/hpc/detached")
    allocation = seen.plan.allocation
    assert allocation is not None
    assert allocation.login.connection == "local"  # srun and squeue run on the node itself
    assert (allocation.job, allocation.nodes) == ("77", ("n1", "n2"))
    assert (seen.chief_host, seen.network) == ("10.0.0.1", "direct")
    # The coordinator is a job step of that job: it ends with it, and must not cancel it for a new one.
    assert realloc.replaceable(laptop) and not realloc.replaceable(seen)
    ended = "slurm job 77 lost a node (RUNNING; node n2 DOWN): its tasks there are lost"
    assert realloc.refusal(seen, ended, attempt=1, attempts=3) == f"cluster 'hpc': {ended}"
