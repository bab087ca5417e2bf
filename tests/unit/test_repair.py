"""`dtf train`'s repair reading the hosts' feed, without a cluster: the watch's feeds set by hand
(what its connections would set), the repairs recorded instead of made. (On fake servers:
tests/fake/test_repair.py; with TensorFlow and spares: tests/e2e/test_outlive.py.)"""

from __future__ import annotations

import threading
import time

from dtf.cluster.inventory import loads
from dtf.cluster.plan import Plan, make_plan
from dtf.cluster.state import Record
from dtf.hostops import repair
from dtf.hostops.parallel import HostOps
from dtf.hostops.repair import Repair
from dtf.hostops.watch import HostFeed
from dtf_server.protocol import TaskSample, TaskStatus, TopSample
from helpers import slurm_record, wait_until

INVENTORY = """\
cluster: c
host_timeout: 30
hosts:
  - host: a
    ps: 1
  - host: b
    workers: 2
spares:
  - host: s1
"""

ALIVE = TaskStatus(alive=True, phase="running", pid=1, server_pid=2, uptime=3.0, serving=True)


def plan() -> Plan:
    return make_plan(loads(INVENTORY, "inv.yaml"), resolve=lambda spec: f"addr-{spec.host}")


class Recorded(Repair):
    """A repair whose repairs are recorded; a restart waits for `release` (a repair under way)."""

    def __init__(self, p: Plan | Record) -> None:
        record = p if isinstance(p, Record) else Record(plan=p, inventory="/x", created=1.0, chief_host="h")
        super().__init__(record, 5.0, lambda line: None)
        self.restarts: list[tuple[str, dict[str, str | None]]] = []
        self.moves: list[str] = []
        self.release = threading.Event()

    def _restart(self, hp, gone):  # type: ignore[no-untyped-def]
        self.restarts.append((hp.name, gone))
        self.release.wait(30)

    def _move(self, lost, waited):  # type: ignore[no-untyped-def]
        self.moves.append(lost.name)


def sample(m: Recorded, host: str, states: dict[str, TaskStatus], at: float | None = None) -> None:
    """What the watch's connection to `host` sets when a sample comes."""
    m.watch._set(host, sample=TopSample(tasks={t: TaskSample(s) for t, s in states.items()}, time=time.time()),
                 at=time.monotonic() if at is None else at, samples=m.watch.feeds()[host].samples + 1)


def test_a_dead_task_in_a_sample_is_started_again_once_and_a_later_sample_is_read_afresh():
    m = Recorded(plan())
    dead = TaskStatus.dead("supervisor is gone")
    sample(m, "a", {"ps:0": ALIVE})
    sample(m, "b", {"worker:0": ALIVE, "worker:1": dead})
    m.look()
    wait_until(lambda: m.restarts)
    assert m.restarts == [("b", {"worker:1": "supervisor is gone"})]
    sample(m, "b", {"worker:0": ALIVE, "worker:1": dead})  # came while the repair went on: stale
    m.look()
    m.release.set()
    wait_until(lambda: "b" not in m.repairing)
    m.look()
    assert len(m.restarts) == 1  # the stale sample is not acted upon
    sample(m, "b", {"worker:0": ALIVE})  # after the repair: worker:1 not reported at all
    m.look()
    wait_until(lambda: len(m.restarts) == 2)
    assert m.restarts[1] == ("b", {"worker:1": "not reported by its host"})
    assert m.moves == []


def test_files_gone_make_every_task_of_the_host_dead():
    m = Recorded(plan())
    m.release.set()
    m.watch._set("b", files_gone=True, at=time.monotonic(), error="dtf's files are gone")
    m.look()
    wait_until(lambda: m.restarts)
    assert m.restarts[0][0] == "b" and set(m.restarts[0][1]) == {"worker:0", "worker:1"}
    assert "dtf's files are gone" in str(m.restarts[0][1]["worker:0"])


def looks(m: Recorded, clock: list[float], seconds: float, answering: list[str], every: float = 2.0) -> None:
    """The repair's looks every `every` seconds for `seconds` of `clock` (its time.monotonic()),
    each host in `answering` sending a sample before each look."""
    end = clock[0] + seconds
    while clock[0] < end:
        clock[0] += every
        for host in answering:
            sample(m, host, {"ps:0": ALIVE} if host == "a" else {"worker:0": ALIVE, "worker:1": ALIVE}, at=clock[0])
        m.look()


def test_a_host_silent_past_the_timeout_while_another_answers_is_lost(monkeypatch):
    clock = [time.monotonic()]
    monkeypatch.setattr(repair.time, "monotonic", lambda: clock[0])
    m = Recorded(plan())
    looks(m, clock, 20, answering=["a", "b"])
    looks(m, clock, 20, answering=["a"])  # b silent 20s: under the timeout
    assert m.moves == []
    looks(m, clock, 12, answering=["a"])  # 32s
    assert m.moves == ["b"] and m.restarts == []


def test_this_machines_own_silence_is_no_hosts(monkeypatch):
    """Every host silent at once (this machine's network dropped), or no look for a while (this
    machine asleep, its processes stopped): no host is blamed, and each host's count starts anew
    once this machine hears from any host again."""
    clock = [time.monotonic()]
    monkeypatch.setattr(repair.time, "monotonic", lambda: clock[0])
    m = Recorded(plan())
    looks(m, clock, 10, answering=["a", "b"])
    looks(m, clock, 300, answering=[])  # nothing heard for ten timeouts (the first 6s of it count)
    assert m.moves == []
    looks(m, clock, 20, answering=["a"])  # a back at once, b still reconnecting: counted from here
    assert m.moves == []
    clock[0] += 600  # asleep: no look for ten minutes, then the samples that were waiting
    looks(m, clock, 2, answering=["a"])
    assert m.moves == []
    looks(m, clock, 12, answering=["a"])  # b silent 28s + 12s while this machine listened
    assert m.moves and set(m.moves) == {"b"}


def test_a_slurm_node_silent_past_the_timeout_is_never_moved():
    """No spares on Slurm: a job that ends is replaced as a whole (dtf.providers.slurm.reallocate)."""
    m = Recorded(slurm_record())
    m.answered = {h: time.monotonic() - 10 * m.plan.host_timeout for h in m.answered}
    m.look()
    assert m.moves == [] and m.lost is None


def test_the_watch_follows_a_new_plan():
    p = plan()
    m = Recorded(p)
    moved = p.moved_to("b", "s1")
    m.watch.follow(HostOps(moved, connect_timeout=5.0))
    feeds = m.watch.feeds()
    assert set(feeds) == {"a", "s1"} and feeds["s1"] == HostFeed()
