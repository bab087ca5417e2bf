"""dtf.program.packer: how many steps per closure, from timed closures (pure: a fake clock and wait)."""

from __future__ import annotations

import pytest

from dtf.program.packer import MAX_STEPS, Measurement, Packer, choose, estimate


def test_estimate_takes_the_fastest_closures_of_one_step_and_of_the_largest_probe() -> None:
    samples = [(1, 2.0), (1, 0.030), (1, 0.026), (4, 0.060), (4, 0.050), (16, 0.2)]
    m = estimate(samples[:5])
    assert m.step == pytest.approx((0.050 - 0.026) / 3)
    assert m.round_trip == pytest.approx(0.026 - m.step)
    with pytest.raises(ValueError):
        estimate([(1, 0.1)])


def test_choose_keeps_the_round_trip_under_the_target_within_the_epoch() -> None:
    m = Measurement(round_trip=0.024, step=0.007)
    k = choose(m, None, workers=2)
    assert m.round_trip / (m.round_trip + k * m.step) <= 0.05 < m.round_trip / (m.round_trip + (k - 1) * m.step)
    assert k == 66
    # 1000 steps at 66 would be 16 closures (15 of 66, one of 10): spread evenly, 16 of at most 63
    assert choose(m, 1000, workers=2) == 63
    # an epoch of 100 steps over 2 workers: at most 50 per closure (both workers busy)
    assert choose(m, 100, workers=2) == 50
    assert choose(Measurement(0.024, 1e-6), None, workers=2) == MAX_STEPS
    assert choose(Measurement(0.001, 0.05), 100, workers=2) == 1  # long steps, short trip: no packing
    # the epoch in a multiple of `workers` closures: 70 steps, 2 workers, need 30 -> 4 closures of 18
    assert choose(Measurement(0.0285, 0.02), 70, workers=2) == 18


class FakeCluster:
    """A closure of n steps takes round_trip + n * step seconds on a fake clock."""

    def __init__(self, round_trip: float, step: float) -> None:
        self.round_trip, self.step, self.now, self.pending = round_trip, step, 0.0, 0
        self.waits = 0

    def clock(self) -> float:
        return self.now

    def schedule(self, n: int) -> None:
        self.pending += n

    def wait(self) -> None:
        self.waits += 1
        self.now += self.round_trip + self.pending * self.step
        self.pending = 0


def test_the_packer_measures_on_the_first_closures_then_packs_and_says_so() -> None:
    cluster, said = FakeCluster(round_trip=0.024, step=0.002), []
    packer = Packer(workers=2, wait=cluster.wait, say=said.append, clock=cluster.clock)
    epochs = []
    for _ in range(3):
        sizes = []
        for n in packer.closures(500):
            cluster.schedule(n)
            sizes.append(n)
        epochs.append(sizes)
    assert [sum(e) for e in epochs] == [500, 500, 500]  # every epoch exactly
    assert epochs[0][:5] == [1, 1, 1, 1, 1]  # each worker's first together (not timed), then 3 timed
    m = packer.measurement
    assert m is not None and m.round_trip == pytest.approx(0.024) and m.step == pytest.approx(0.002)
    assert packer.chosen == choose(m, 500, 2) and packer.chosen > 100
    assert set(epochs[2][:-1]) == {packer.chosen}
    assert said == [f"packing {packer.chosen} steps per closure (round trip 24.0 ms, step 2.00 ms)"]
    waits = cluster.waits
    for _ in packer.closures(500):
        pass
    assert cluster.waits == waits  # measured once: no more waiting


def test_an_explicit_value_is_used_as_it_is_and_nothing_is_measured() -> None:
    cluster = FakeCluster(round_trip=0.024, step=0.002)
    packer = Packer(workers=2, wait=cluster.wait, explicit=7, clock=cluster.clock)
    assert list(packer.closures(30)) == [7, 7, 7, 7, 2]
    assert cluster.waits == 0 and packer.measurement is None
    with pytest.raises(ValueError):
        Packer(workers=2, wait=cluster.wait, explicit=0)


def test_tiny_epochs_measure_across_epochs_and_never_overrun_one() -> None:
    cluster, said = FakeCluster(round_trip=0.024, step=0.002), []
    packer = Packer(workers=2, wait=cluster.wait, say=said.append, clock=cluster.clock)
    for _ in range(20):
        sizes = list(packer.closures(3))
        assert sum(sizes) == 3
    assert packer.chosen == 2  # an epoch of 3 steps over 2 workers
    assert said and "packing 2 steps per closure" in said[0]


def test_no_epoch_length_packs_until_the_caller_stops() -> None:
    cluster = FakeCluster(round_trip=0.024, step=0.0001)
    packer = Packer(workers=1, wait=cluster.wait, clock=cluster.clock)
    sizes = []
    for n in packer.closures(None):
        cluster.schedule(n)
        sizes.append(n)
        if len(sizes) == 30:
            break
    assert sizes[-1] == MAX_STEPS


def test_the_packer_tells_the_figures_each_closures_steps_until_its_loop_ends() -> None:
    """While a loop of `closures()` schedules, the figures know each closure's steps (what `dtf
    train` counts per worker); after it, a closure the program schedules itself is of steps
    unknown again (an evaluation, a loop of its own)."""
    from dtf.program import figures

    cluster = FakeCluster(round_trip=0.024, step=0.002)
    packer = Packer(workers=2, wait=cluster.wait, explicit=7, clock=cluster.clock)
    seen = []
    for n in packer.closures(20):
        seen.append((n, figures.next_steps, figures.told))
    assert seen == [(7, 7, True), (7, 7, True), (6, 6, True)]
    assert (figures.next_steps, figures.told) == (1, False)
    for _ in packer.closures(20):
        break  # a loop left early ends the same way
    assert (figures.next_steps, figures.told) == (1, False)
