"""dtf.providers.slurm.reallocate without a lab: which ended job dtf replaces, the record's allocation fields,
the job watch's pace, and `dtf top`'s line for it (tests/slurm/test_comeback.py: on the Slurm lab)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dtf import top
from dtf.cluster import state
from dtf.cluster.state import Record
from dtf.hostops import realloc
from helpers import slurm_record

ENDED = "slurm job 77 lost a node (NODE_FAIL; node n2 DOWN+NOT_RESPONDING: Not responding): its tasks ended with it"


def test_only_a_job_dtf_submitted_is_replaced_while_attempts_are_left() -> None:
    assert realloc.refusal(slurm_record(), ENDED, attempt=1, attempts=3) is None
    assert realloc.refusal(slurm_record(), ENDED, attempt=3, attempts=3) == (
        f"cluster 'hpc': {ENDED}; no attempts left (--attempts 3)")
    # The inventory's `job:`: the line as before, whatever the attempts.
    assert realloc.refusal(slurm_record(submitted=False), ENDED, attempt=1, attempts=3) == f"cluster 'hpc': {ENDED}"
    assert not realloc.replaceable(slurm_record(submitted=False))


def test_the_allocation_and_the_jobs_replaced_are_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTF_HOME", str(tmp_path))
    record = slurm_record().replace(allocation=2, replaced=[f"77: {ENDED}"])
    state.save(record)
    again = state.load("hpc")
    assert (again.allocation, again.replaced) == (2, [f"77: {ENDED}"])
    # A record written before these fields: the first allocation, nothing replaced.
    data = json.loads(state.path_of("hpc").read_text())
    del data["allocation"], data["replaced"]
    state.path_of("hpc").write_text(json.dumps(data))
    old = state.load("hpc")
    assert (old.allocation, old.replaced) == (1, [])


def test_the_job_watch_asks_slurm_at_its_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(realloc.time, "monotonic", lambda: now[0])
    asked: list[float] = []
    answers = [None, ENDED]

    def job_ended(record: Record, connect_timeout: float) -> str | None:
        asked.append(now[0])
        return answers[len(asked) - 1]

    watch = realloc.JobWatch(slurm_record(), 5.0, job_ended)
    assert not watch() and asked == []  # not before JOB_POLL seconds
    now[0] += realloc.JOB_POLL
    assert not watch() and asked == [now[0]]
    now[0] += realloc.JOB_POLL / 2
    assert not watch() and len(asked) == 1
    now[0] += realloc.JOB_POLL
    assert watch() and watch.ended == ENDED
    # A cluster of hosts has no job to end: never asked.
    hosts = slurm_record()
    hosts = hosts.replace(plan=dataclasses.replace(hosts.plan, allocation=None))
    never = realloc.JobWatch(hosts, 5.0, job_ended)
    now[0] += 10 * realloc.JOB_POLL
    assert not never() and len(asked) == 2


def test_top_says_the_job_and_the_wait_for_a_new_one() -> None:
    train = {"mode": "ps", "attempt": 2, "attempts": 3, "last_retry": "slurm job 77 ended during attempt 1",
             "waiting_for_ps": False, "slurm_job": "78", "reallocating": False, "steps": None}
    assert top.training_lines(train)[0] == ("training (ps): attempt 2 of 3 on slurm job 78 | the program has "
                                            "scheduled nothing yet")
    waiting = {**train, "attempt": 1, "slurm_job": "77", "reallocating": True}
    assert top.training_lines(waiting)[0].startswith(
        "training (ps): attempt 1 of 3 on slurm job 77, waiting for a new Slurm allocation")
