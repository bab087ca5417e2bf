"""`dtf up`'s rollback after Ctrl-C, with the hosts' operations replaced (no processes, no hosts)."""

from __future__ import annotations

from typing import Any

import pytest

from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.errors import HostFailure
from dtf.hostops import lifecycle, stop
from dtf.hostops.parallel import HostOps, Outcome
from dtf.hostops.start import Starter

PLAN = "[{host: a, ps: 1, workers: 1}, {host: b, workers: 1}]"


def interrupted_start(monkeypatch: pytest.MonkeyPatch, stop_fails: int) -> tuple[HostOps, list[float]]:
    """A start Ctrl-C interrupts once both hosts started tasks; the first `stop_fails` stops
    of host a fail (a stop command cut short, as on a loaded host)."""
    ops = HostOps(make_plan(loads(f"cluster: c\nhosts: {PLAN}\n", "inventory.yaml")))

    def up(self: Starter, only: Any = None) -> dict[str, Outcome[Any]]:
        self.touched |= {"a", "b"}
        self.started |= {"a", "b"}
        ops.cancel.set()  # Ctrl-C while they started
        return {h: Outcome(h, False, reason="interrupted") for h in ("a", "b")}

    graces: list[float] = []

    def down(undo: HostOps, keep_logs: bool = False, grace: float = stop.STOP_GRACE,
             hosts: Any = None, purge: bool = False) -> dict[str, Outcome[Any]]:
        out = {}
        for hp in hosts:
            if hp.name == "a":
                graces.append(grace)
            fail = hp.name == "a" and len(graces) <= stop_fails
            out[hp.name] = Outcome(hp.name, not fail, reason="command timed out after 40s" if fail else "",
                                   data=None if fail else stop.HostStopped({}))
        return out

    monkeypatch.setattr(Starter, "up", up)
    monkeypatch.setattr(stop, "down", down)
    monkeypatch.setattr(stop, "remove_launcher", lambda undo, hosts: {})
    return ops, graces


def test_a_stop_cut_short_is_run_again_with_kill_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, graces = interrupted_start(monkeypatch, stop_fails=1)
    with pytest.raises(KeyboardInterrupt):  # rolled back: Ctrl-C's own ending
        lifecycle.start(ops, None)
    assert graces == [stop.STOP_GRACE, 0]


def test_a_failed_rollback_is_never_hidden_behind_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    ops, graces = interrupted_start(monkeypatch, stop_fails=2)
    with pytest.raises(HostFailure) as e:
        lifecycle.start(ops, None)
    assert e.value.lines() == ["dtf up (interrupted) failed on 1 host(s):",
                               "  a: interrupted; rollback failed: command timed out after 40s"]
    assert graces == [stop.STOP_GRACE, 0]
