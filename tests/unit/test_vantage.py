"""dtf.detached.vantage without a lab: a Slurm cluster as its detached coordinator sees it from the
node it runs on (tests/slurm/test_slurm_detached.py: on the Slurm lab)."""

from __future__ import annotations

import textwrap

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.cluster.state import Record
from dtf.detached import vantage
from dtf.hostops import realloc
from dtf.providers.slurm import commands as slurm

INVENTORY = """\
cluster: hpc
defaults: {python: /opt/tf/bin/python3, workdir: ~/.dtf}
slurm:
  login: {host: login.example.org}
  nodes: 2
  ps: 1
  workers: 1
"""


def slurm_record() -> Record:
    inv = loads(textwrap.dedent(INVENTORY), "inventory.yaml")
    assert inv.slurm is not None
    alloc = Allocation(job="77", submitted=True, login=inv.slurm.login, nodes=("n1", "n2"),
                       addresses=("10.0.0.1", "10.0.0.2"), request=slurm.request(inv))
    return Record(plan=make_plan(inv.with_nodes(alloc.nodes), allocation=alloc), inventory="/x/inventory.yaml",
                  created=1.0, chief_host="10.0.0.9")


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
