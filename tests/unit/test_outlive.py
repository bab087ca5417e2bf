"""Spares and moves without a cluster: the inventory's `spares:` and `host_timeout`, a plan's move of
a lost host's tasks to a spare (and its round trip through the record), `dtf up` from the same
inventory after a move, and how `dtf status`/`dtf top` show a task dtf brought back."""

from __future__ import annotations

import os
import time

import pytest
from rich.console import Console

from dtf import top, ui
from dtf.cluster.inventory import DEFAULT_HOST_TIMEOUT, loads
from dtf.cluster.plan import HostPlan, Plan, differences, make_plan
from dtf.cluster.state import Record
from dtf.errors import InventoryError
from dtf.hostops import repair
from dtf.hostops.repair import Repair
from dtf.hostops.status import TaskState
from dtf.hostops.watch import HostFeed
from dtf_server.protocol import TaskSample, TaskStatus, TopSample

INVENTORY = """\
cluster: c
host_timeout: 2m
hosts:
  - host: a
    ps: 1
  - host: b
    workers: 2
spares:
  - host: s1
    workdir: /srv/spare
  - host: s2
    python: /opt/tf/bin/python
"""


def errors(text: str) -> list[str]:
    with pytest.raises(InventoryError) as e:
        loads(text, "inv.yaml")
    return [str(p) for p in e.value.problems]


def plan() -> Plan:
    return make_plan(loads(INVENTORY, "inv.yaml"), resolve=lambda spec: f"addr-{spec.host}")


def test_spares_and_host_timeout_are_read_with_the_defaults():
    inv = loads(INVENTORY, "inv.yaml")
    assert inv.host_timeout == 120
    assert [(s.host, s.workdir, s.python, s.ps_ports, s.worker_ports) for s in inv.spares] == [
        ("s1", "/srv/spare", "python3", (), ()), ("s2", "~/.dtf", "/opt/tf/bin/python", (), ())]
    assert loads("cluster: c\nhosts: [{host: a, workers: 1}]\n").host_timeout == DEFAULT_HOST_TIMEOUT
    assert loads("cluster: c\nhost_timeout: 90s\nhosts: [{host: a, workers: 1}]\n").host_timeout == 90


def test_a_spare_is_no_host_runs_no_task_and_is_listed_once():
    assert errors("cluster: c\nhosts:\n  - {host: a, workers: 1}\nspares:\n  - host: A\n  - {host: b, ps: 1}\n"
                  "  - host: c\n  - host: c\n  - {host: d, connection: local}\n  - d\n") == [
        "inv.yaml:5:11: spares[0].host: host 'A' is in hosts already (line 3): a spare stands by for the hosts, "
        "apart from them",
        "inv.yaml:6:15: spares[1].ps: not on a spare: it takes over the tasks of a lost host, on their ports",
        "inv.yaml:8:11: spares[3].host: host 'c' is a spare already: a spare stands by for the hosts, apart from them",
        "inv.yaml:9:15: spares[4].connection: not on a spare: a spare is another machine, reached by SSH",
        "inv.yaml:10:5: spares[5]: expected a mapping with at least a host key, got 'd'"]


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-5", "-5"), ("2d", "'2d'"), ("yes", "a boolean (yes)"),
                                          ("90000", "90000")])
def test_host_timeout_is_a_positive_duration_of_at_most_a_day(value, shown):
    assert errors(f"cluster: c\nhost_timeout: {value}\nhosts: [{{host: a, workers: 1}}]\n") == [
        f"inv.yaml:2:1: host_timeout: expected a duration more than 0 and at most 1 day (60, 90s, 2m), got {shown}"]


def test_no_spares_with_slurm():
    text = "cluster: c\nslurm: {login: l, nodes: 1, workers: 1}\nspares: [{host: x}]\n"
    assert errors(text) == ["inv.yaml:3:1: spares: not with slurm: Slurm decides where tasks run"]


def test_a_move_puts_the_lost_hosts_tasks_on_the_spare_at_the_same_ports():
    p = plan()
    assert [sp.name for sp in p.spares] == ["s1", "s2"] and p.host_timeout == 120
    assert p.spares[0].spec.address == "addr-s1"  # resolved at `up`: a move needs no resolver
    moved = p.moved_to("b", "s1")
    assert [h.name for h in moved.hosts] == ["a", "s1"] and [sp.name for sp in moved.spares] == ["s2"]
    assert moved.moved == (("b", "s1"),)
    was = {t.name: t for t in p.tasks()}
    for t in moved.tasks():
        if t.job == "ps":
            assert t == was[t.name]
            continue
        assert (t.job, t.index, t.port) == (was[t.name].job, was[t.name].index, was[t.name].port)
        assert (t.host, t.address) == ("s1", f"addr-s1:{t.port}")
        assert t.dir.startswith("/srv/spare/c/") and t.serve_argv[1].startswith("/srv/spare/c/launcher-")
    assert moved.cluster_spec()["worker"] == ["addr-s1:2222", "addr-s1:2223"]
    with pytest.raises(ValueError):
        moved.moved_to("b", "s2")  # b is no longer in the plan


def test_the_firewall_lets_the_spares_in_from_the_start():
    """Under the default firewall every host's rules let the spares in: tasks moved to one reach
    the others with no rule changed on them, and the spare's own rules let every member in."""
    def allowed(hp: HostPlan) -> list[str]:
        return list(hp.firewall.allow)

    p = plan()
    assert p.firewall == "auto"
    assert all(allowed(hp) == ["addr-a", "addr-b", "addr-s1", "addr-s2"] for hp in p.hosts)
    moved = p.moved_to("b", "s1")
    assert allowed(moved.hosts[0]) == ["addr-a", "addr-s1", "addr-s2"]  # a repair of a sets the same
    assert allowed(moved.hosts[1]) == ["addr-a", "addr-s1", "addr-s2"]
    assert moved.hosts[1].firewall.mode == "auto" and 2223 in moved.hosts[1].firewall.ports


def test_a_moved_plan_round_trips_through_the_record():
    moved = plan().moved_to("a", "s2")
    record = Record(plan=moved, inventory="/x/inv.yaml", created=1.0, chief_host="10.0.0.1",
                    recovered={"ps:0": "moved from a to spare s2 at 10:00:00 (a unanswered for 121s)"})
    again = Record.from_dict(record.to_dict())
    assert again == record and again.plan.spares == moved.spares and again.plan.moved == (("a", "s2"),)


def test_up_from_the_same_inventory_after_a_move_changes_nothing():
    moved = plan().moved_to("b", "s1")
    assert differences(moved, plan().with_moves(moved.moved)) == []
    assert "host b: added" in differences(moved, plan())  # the inventory's plan as it is, without the move
    # An inventory that no longer has the spare: the move does not apply, and `up` says what differs.
    fewer = make_plan(loads(INVENTORY.replace("  - host: s1\n    workdir: /srv/spare\n", ""), "inv.yaml"),
                      resolve=lambda spec: f"addr-{spec.host}")
    assert fewer.with_moves(moved.moved) == fewer
    assert differences(moved, fewer)[:3] == ["host b: added", "host s1: removed",
                                             "task worker:0: s1 addr-s1:2222 -> b addr-b:2222"]


def test_the_one_line_of_a_host_lost_with_no_spare_left():
    p = plan()
    line = repair.no_spare_line(p, p.hosts[1], 121.4)
    assert line == ("cluster 'c': host b unanswered for 121s (host_timeout 120s) and no spare left to take its "
                    "tasks (worker:0, worker:1)")


def test_status_and_top_show_what_dtf_did():
    p = plan()
    note = "restarted by dtf at 10:00:00 (supervisor is gone)"
    ok = TaskStatus(alive=True, phase="running", pid=1, server_pid=2, uptime=3.0, serving=True)
    rows = ui.status_rows([TaskState(t, "alive", None, ok) for t in p.tasks()], {"worker:1": note})
    assert [r["recovered"] for r in rows] == [None, None, note]
    feeds = {hp.name: HostFeed(sample=TopSample(tasks={t.name: TaskSample(ok, cpu=1.0, rss=1, net_in=0.0,
                                                                           net_out=0.0) for t in hp.tasks},
                                                time=time.time()), samples=2, connects=1) for hp in p.hosts}
    doc = top.snapshot(p, feeds, None, {"worker:1": note})
    assert [r["recovered"] for r in doc["tasks"]] == [None, None, note]
    console = Console(width=160, height=40, record=True, file=open(os.devnull, "w"))
    console.print(top.view(doc, 40))
    assert "alive (restarted by dtf)" in console.export_text()


def test_the_repair_stops_the_program_only_for_a_change():
    p = plan()
    repair = Repair(Record(plan=p, inventory="/x", created=1.0, chief_host="h"), 5.0, lambda line: None)
    assert repair.stop_reason(0) is None
    repair.changes = 1
    assert "tasks moved to a spare" in str(repair.stop_reason(0)) and repair.stop_reason(1) is None
    repair.lost = "x"
    assert "no spare is left" in str(repair.stop_reason(1))
