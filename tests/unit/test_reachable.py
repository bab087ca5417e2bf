"""`up`'s check that this machine reaches each started task (Starter._reachable): directly, or
through SSH to its host (a Slurm node: to its login host), with stand-ins for both probes."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.cluster.slurm import Allocation
from dtf.hostops import start
from dtf.hostops.parallel import HostOps
from dtf.hostops.start import Starter
from dtf.hosts.transport import Transport


class Through:
    """The host's transport: every task is reached through SSH at once (its `reaches`)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def reaches(self, target: str, timeout: float) -> bool:
        self.asked.append(target)
        return True


def starter(network: str, slurm: bool) -> tuple[Starter, Any]:
    if slurm:
        inv = loads(f"cluster: c\nnetwork: {network}\nslurm: {{login: l, nodes: 1, ps: 1, workers: 1}}\n")
        assert inv.slurm is not None
        allocation = Allocation(job="7", submitted=True, login=inv.slurm.login, nodes=("n1",), addresses=("10.0.0.1",))
        plan = make_plan(inv.with_nodes(allocation.nodes), slurm=allocation)
    else:
        plan = make_plan(loads(f"cluster: c\nnetwork: {network}\nhosts: [{{host: a, address: 10.0.0.1, ps: 1, "
                               f"workers: 1}}]\n"))
    return Starter(HostOps(plan)), plan.hosts[0]


@pytest.mark.parametrize("slurm", [False, True])
@pytest.mark.parametrize("network, direct, expected, through", [
    ("auto", True, True, None),  # an SSH host reached directly: no probe through SSH (a Slurm node's go anyway)
    ("auto", False, False, True),
    ("ssh", True, True, True),  # (ssh mode: through SSH whatever; `up` says the ports are open)
    ("ssh", False, False, True),
])
def test_direct_or_through_ssh(slurm: bool, network: str, direct: bool, expected: bool, through: bool | None,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(start, "port_open", lambda host, port, timeout: direct)
    s, hp = starter(network, slurm)
    t = Through()
    assert s._reachable(cast(Transport, t), hp, hp.tasks) is expected
    if through is not None:
        assert bool(t.asked) is through
    elif not slurm:
        assert t.asked == []


def test_a_slurm_nodes_dropped_direct_probes_do_not_hold_up_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A site whose firewall drops this machine's packets to the compute nodes: the probes through
    the login host answer, the direct ones never do. The node is reached through SSH (not directly)
    a moment later, not once the direct probes' time is up (DIRECT_PROBE: here a minute)."""
    dropped = threading.Event()  # (never set: the packets go nowhere)

    def port_open(host: str, port: int, timeout: float) -> bool:
        dropped.wait(timeout)
        return False

    monkeypatch.setattr(start, "port_open", port_open)
    monkeypatch.setattr(start, "DIRECT_PROBE", 60.0)
    s, hp = starter("auto", slurm=True)
    t = Through()
    t0 = time.monotonic()
    assert s._reachable(cast(Transport, t), hp, hp.tasks) is False
    assert time.monotonic() - t0 < 30 and sorted(t.asked) == ["10.0.0.1:2222", "10.0.0.1:2223"]
