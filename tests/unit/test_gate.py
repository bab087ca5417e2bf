"""`dtf up`'s meeting point where hosts start in turns (dtf.hostops.start._Gate): each host, its
servers up, waits there until every host's serve (go) or one failed or Ctrl-C (stop)."""

from __future__ import annotations

import threading

from dtf.hostops.start import _Gate


class CountingCondition(threading.Condition):
    """A Condition that counts its notify_all calls: each wakes every waiting host."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def notify_all(self) -> None:
        self.wakeups += 1
        super().notify_all()


def gate(hosts: int) -> tuple[_Gate, CountingCondition, threading.Event]:
    cancel = threading.Event()
    g = _Gate(hosts, 2, 60, cancel)
    g._changed = CountingCondition()
    return g, g._changed, cancel


def waiting(g: _Gate) -> tuple[threading.Thread, list[bool]]:
    """A host waiting in all_serve, and what it was told once it returns."""
    told: list[bool] = []
    thread = threading.Thread(target=lambda: told.append(g.all_serve()), daemon=True)
    thread.start()
    return thread, told


def test_every_host_is_told_go_once_all_arrived_with_one_wakeup() -> None:
    """The waiting hosts are woken by the outcome, not by each arrival: a wake-up of every waiting
    host per arrival would make each host's share of up's CPU grow with the number of hosts."""
    g, changed, _ = gate(4)
    hosts = [waiting(g) for _ in range(3)]
    for _ in range(3):
        g.arrive(True)
    assert changed.wakeups == 0
    g.arrive(True)  # the last one (it does not wait: everyone is there)
    for thread, told in hosts:
        thread.join(30)
        assert told == [True]
    assert g.all_serve()
    assert changed.wakeups == 1


def test_a_failed_host_tells_the_waiting_ones_stop() -> None:
    g, changed, _ = gate(3)
    thread, told = waiting(g)
    g.arrive(True)
    g.arrive(False)
    thread.join(30)
    assert told == [False]
    assert changed.wakeups == 1
    g.arrive(True)  # a host still in its turn arrives later: it is told stop too
    assert not g.all_serve()


def test_ctrl_c_tells_the_waiting_hosts_stop() -> None:
    g, _, cancel = gate(3)
    thread, told = waiting(g)
    g.arrive(True)
    cancel.set()
    thread.join(30)
    assert told == [False]
