"""`up`'s check that this machine reaches each started task (dtf.providers.route.check_reach):
directly, or through SSH to its host (a Slurm node: to its login host), with stand-ins for both probes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import loads
from dtf.cluster.plan import Plan, make_plan
from dtf.hosts.base import CommandRunner
from dtf.providers import route
from helpers import within


class Through:
    """The host's transport: every task is reached through SSH at once (its `reaches`); a Slurm
    node's through the login host in front of it (`front`)."""

    def __init__(self, front: bool = False) -> None:
        self.asked: list[str] = []
        self.front = front

    def reaches(self, target: str, timeout: float) -> bool:
        self.asked.append(target)
        return True

    def through_front(self) -> bool:
        return self.front


class Starter:
    """What `up`'s start asks of the route, for one host of `plan`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def _reachable(self, t: Any, hp: Any, tasks: Any) -> bool:
        return route.check_reach(self.plan, cast(CommandRunner, t), hp, tasks)


def starter(network: str, slurm: bool) -> tuple[Starter, Any]:
    if slurm:
        inv = loads(f"cluster: c\nnetwork: {network}\nslurm: {{login: l, nodes: 1, ps: 1, workers: 1}}\n")
        assert inv.slurm is not None
        allocation = Allocation(job="7", submitted=True, login=inv.slurm.login, nodes=("n1",), addresses=("10.0.0.1",))
        plan = make_plan(inv.with_nodes(allocation.nodes), allocation=allocation)
    else:
        plan = make_plan(loads(f"cluster: c\nnetwork: {network}\nhosts: [{{host: a, address: 10.0.0.1, ps: 1, "
                               f"workers: 1}}]\n"))
    return Starter(plan), plan.hosts[0]


@pytest.mark.parametrize("slurm", [False, True])
@pytest.mark.parametrize("network, direct, expected, through", [
    ("auto", True, True, None),  # an SSH host reached directly: no probe through SSH (a Slurm node's go anyway)
    ("auto", False, False, True),
    ("ssh", True, True, True),  # (ssh mode: through SSH whatever; `up` says the ports are open)
    ("ssh", False, False, True),
])
def test_direct_or_through_ssh(slurm: bool, network: str, direct: bool, expected: bool, through: bool | None,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route, "port_open", lambda host, port, timeout: direct)
    s, hp = starter(network, slurm)
    t = Through(front=slurm)
    assert s._reachable(cast(CommandRunner, t), hp, hp.tasks) is expected
    if through is not None:
        assert bool(t.asked) is through
    elif not slurm:
        assert t.asked == []


@pytest.mark.parametrize("slurm", [False, True])
@pytest.mark.parametrize("network", ["auto", "ssh"])
def test_dropped_direct_probes_hold_up_neither_the_start_nor_the_exit(slurm: bool, network: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A firewall that drops this machine's packets to the hosts' TF ports (a site's compute nodes,
    cloud hosts with only port 22 open): the probes through SSH answer, the direct ones never do.
    The host is reached through SSH (not directly) a moment later, not once the direct probes' time
    is up (DIRECT_PROBE: here a minute); and no thread that the interpreter's exit joins is left
    waiting on them (a thread pool's workers are: `dtf up` stayed alive DIRECT_PROBE seconds after
    its last line)."""
    dropped = threading.Event()  # (never set: the packets go nowhere)
    tried: list[int] = []

    def port_open(host: str, port: int, timeout: float) -> bool:
        tried.append(port)
        dropped.wait(timeout)
        return False

    monkeypatch.setattr(route, "port_open", port_open)
    monkeypatch.setattr(route, "DIRECT_PROBE", 3600.0)
    s, hp = starter(network, slurm=slurm)
    t = Through(front=slurm)
    assert within(60, lambda: s._reachable(cast(CommandRunner, t), hp, hp.tasks)) is False
    assert sorted(t.asked) == ["10.0.0.1:2222", "10.0.0.1:2223"]
    assert sorted(tried) == [2222, 2223]
    dropped.set()


def test_a_process_ends_with_its_last_word_whatever_the_dropped_probes(tmp_path: Path) -> None:
    """The same in a process of its own, which must end once `_reachable` has answered: the
    interpreter's exit joins a thread pool's workers (daemon or not), and `dtf up` stayed alive
    DIRECT_PROBE seconds after its last line while they waited on dropped connections."""
    program = tmp_path / "probe.py"
    program.write_text(textwrap.dedent("""
        import sys, threading, time
        sys.path[:0] = [sys.argv[1], sys.argv[1] + "/.."]  # (test_reachable imports tests/helpers)
        import test_reachable as tr
        from dtf.providers import route
        route.DIRECT_PROBE = 3600.0
        route.port_open = lambda host, port, timeout: threading.Event().wait(timeout) and False
        s, hp = tr.starter("auto", slurm=True)
        print(s._reachable(tr.Through(front=True), hp, hp.tasks), flush=True)
    """))
    r = subprocess.run([sys.executable, str(program), str(Path(__file__).parent)], capture_output=True, text=True,
                       timeout=120)  # (not the hour of DIRECT_PROBE)
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr


def test_an_ssh_hosts_slow_direct_answer_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host far away whose ports answer directly, later than DIRECT_FIRST: the probes through SSH
    (which cross the same network, and more) take longer still, and the direct answer counts."""
    monkeypatch.setattr(route, "DIRECT_FIRST", 0.0)
    answered = threading.Event()

    def port_open(host: str, port: int, timeout: float) -> bool:
        time.sleep(0.2)
        answered.set()
        return True

    class Far(Through):
        def reaches(self, target: str, timeout: float) -> bool:
            assert answered.wait(60)  # (a thread the machine's load holds up: the order stays)
            time.sleep(0.3)
            return super().reaches(target, timeout)

    monkeypatch.setattr(route, "port_open", port_open)
    s, hp = starter("auto", slurm=False)
    assert s._reachable(cast(CommandRunner, Far()), hp, hp.tasks) is True


def test_probe_all_answers_in_order_and_raises_a_probes_error() -> None:
    """dtf.hosts.netutil.probe_all, on its daemon threads, as a thread pool's map would."""
    from dtf.hosts.netutil import probe_all

    tasks = list(range(40))  # (more than PROBES_AT_ONCE)
    assert probe_all(lambda i: i % 3 == 0, cast(Any, tasks)) == [i % 3 == 0 for i in tasks]
    assert probe_all(lambda i: True, []) == []

    def broken(i: int) -> bool:
        if i == 7:
            raise ValueError("a bug in a probe")
        return True

    with pytest.raises(ValueError, match="a bug in a probe"):
        probe_all(broken, cast(Any, tasks))


def test_the_mesh_check_tries_the_pairs_training_connects():
    """`up`'s mesh check from a host (reach.others): with ps tasks, a host's workers the other
    hosts' ps, its ps their workers (ParameterServerStrategy's device filters: no worker ever
    connects to another, nor a ps to a ps), so 100 hosts of one ps make 198 connections, not
    9,900; without ps (a cluster for `train --collective` only) every other worker."""
    from dtf.hostops.reach import others

    def plan(hosts: str):  # type: ignore[no-untyped-def]
        return make_plan(loads(f"cluster: c\nhosts:\n{hosts}", "inv.yaml"), resolve=lambda spec: spec.host,
                         server="fake")

    p = plan("  - {host: a, ps: 1}\n  - {host: b, workers: 2}\n  - {host: c, workers: 1}\n"
             "  - {host: d, ps: 1, workers: 1}\n")
    hosts = {hp.name: hp for hp in p.hosts}

    def names(host: str) -> list[str]:
        return sorted(t.name for t in others(p, hosts[host]).values())

    assert names("a") == ["worker:0", "worker:1", "worker:2", "worker:3"]  # a ps: every other host's workers
    assert names("b") == ["ps:0", "ps:1"]  # workers: the other hosts' ps
    assert names("c") == ["ps:0", "ps:1"]
    assert names("d") == ["ps:0", "worker:0", "worker:1", "worker:2"]  # both: both (its own host's: none)
    assert all(t.host != "d" for t in others(p, hosts["d"]).values())

    big = plan("".join(f"  - {{host: h{i}, {'ps' if i == 0 else 'workers'}: 1}}\n" for i in range(100)))
    assert sum(len(others(big, hp)) for hp in big.hosts) == 198

    collective = plan("  - {host: a, workers: 1}\n  - {host: b, workers: 2}\n")
    assert sorted(t.name for t in others(collective, collective.hosts[0]).values()) == ["worker:1", "worker:2"]
