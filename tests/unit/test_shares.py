"""What each worker did in a `dtf train` run: the coordinator's figures (dtf.program.figures),
summed over the attempts (Shares), and the block printed after the run (dtf.ui.show_shares)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtf import ui
from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.program import figures


def attempt(path: Path, *closures: tuple[int, int, float, bool]) -> dict:
    """The last train.json of an attempt whose coordinator saw these closures (worker, steps,
    seconds, told) complete."""
    f = figures.Figures(path)
    for worker, steps, seconds, told in closures:
        f.closure_done(worker, steps, seconds, told=told)
    f.publish()
    doc = figures.read(path)
    assert doc is not None
    return doc


def test_shares_are_summed_over_attempts_with_only_known_steps_counted(tmp_path: Path) -> None:
    shares = figures.Shares()
    hosts = {0: "h1", 1: "h2", 2: "h3"}
    shares.add(attempt(tmp_path / "1.json", (0, 10, 1.0, True), (0, 10, 1.5, True), (1, 10, 2.0, True)), hosts)
    shares.add(None, hosts)  # an attempt that ended before it scheduled anything
    # The second attempt: worker:1 moved to h4; one closure of evaluate()'s (steps unknown).
    shares.add(attempt(tmp_path / "2.json", (1, 10, 1.0, True), (1, 1, 0.25, False)), {**hosts, 1: "h4"})
    assert shares.attempts == 2
    assert shares.workers == {0: figures.Share("h1", closures=2, steps=20, unknown=0, busy=2.5),
                              1: figures.Share("h4", closures=3, steps=20, unknown=1, busy=3.25),
                              2: figures.Share("h3")}  # a worker that ran nothing is listed too
    assert (shares.closures, shares.steps, shares.unknown) == (5, 40, 1)


def test_the_block_after_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shares = figures.Shares()
    shares.add(attempt(tmp_path / "1.json", (0, 10, 1.0, True), (0, 10, 1.5, True), (1, 20, 2.0, True),
                       (1, 1, 0.002, False)), {0: "h1", 1: "h2"})
    ui.show_shares(shares, 12.34)
    out, err = capsys.readouterr()
    assert out == ""  # dtf's lines go to stderr: the program's stdout stays the program's
    assert err.splitlines() == [
        "dtf: what each worker did in 12.3s, as the coordinator counted it (time: how long its closures took, "
        "round trips included):",
        "task      host  closures  steps  share  time",
        "worker:0  h1    2         20     50%    2.5s",
        "worker:1  h2    2         20     50%    2.0s",
        "steps leave out 1 closure(s) whose steps dtf does not know (evaluate()'s shards, or functions the "
        "program schedules without dtf.packing())"]


def test_a_run_of_closures_whose_steps_are_unknown_shares_its_closures(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    shares = figures.Shares()
    shares.add(attempt(tmp_path / "1.json", *[(i % 2, 1, 0.004, False) for i in range(3)]), {0: "h1", 1: "h1"})
    shares.add(attempt(tmp_path / "2.json", (1, 1, 0.004, False)), {0: "h1", 1: "h1"})
    ui.show_shares(shares, 3.0)
    assert capsys.readouterr().err.splitlines() == [
        "dtf: what each worker did in 3.0s over 2 attempts, as the coordinator counted it (time: how long its "
        "closures took, round trips included):",
        "task      host  closures  share  time",
        "worker:0  h1    2         50%    8ms",
        "worker:1  h1    2         50%    8ms",
        "no steps: dtf does not know how many each closure ran (evaluate()'s shards, or functions the program "
        "schedules without dtf.packing())"]


def test_nothing_is_said_of_a_run_without_closures(capsys: pytest.CaptureFixture[str]) -> None:
    shares = figures.Shares()
    shares.add(None, {0: "h1"})
    ui.show_shares(shares, 1.0)
    assert capsys.readouterr() == ("", "")


def test_each_attempts_figures_are_collected_once_it_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dtf train` reads the program's last train.json after each attempt, and removes it: the
    next attempt's program writes its own, and one that writes none adds nothing."""
    from dtf.program.train import RunFigures

    monkeypatch.setenv("DTF_HOME", str(tmp_path))
    plan = make_plan(loads("cluster: c\nhosts: [{host: a, ps: 1}, {host: b, workers: 2}]\n", "i.yaml"),
                     resolve=lambda spec: spec.host, server="fake")
    live = figures.live_dir(tmp_path, "c")
    with RunFigures("c", attempts=2) as run:
        f = figures.Figures(live / figures.TRAIN)
        f.closure_done(1, 5, 0.5)
        f.publish()
        run.collect(plan)
        assert not (live / figures.TRAIN).exists()
        run.collect(plan)  # an attempt that published nothing
    assert run.shares.attempts == 1
    assert run.shares.workers == {0: figures.Share("b"), 1: figures.Share("b", closures=1, steps=5, busy=0.5)}
    assert not live.exists()


@pytest.mark.parametrize(("code", "reported"), [(0, True), (1, False), (130, False)])
def test_only_a_program_that_succeeded_has_its_run_reported(monkeypatch: pytest.MonkeyPatch, code: int,
                                                            reported: bool) -> None:
    """A failed or interrupted run ends with its error (or dtf's line about the interrupt)."""
    from dtf.program import train

    monkeypatch.setattr(train, "_attempts", lambda *args: code)
    seen: list[figures.Shares] = []
    assert train.run_program(None, "p.py", [], None, report=seen.append) == code  # type: ignore[arg-type]
    assert len(seen) == int(reported)
