"""Collective mode's pure parts and its watch loop with fake followers (no TensorFlow, no hosts)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from dtf.cluster import gpus
from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.cluster.state import Record
from dtf.collective import follow
from dtf.collective import run as collective


def plan_of(hosts: str) -> Any:
    return make_plan(loads(f"cluster: c\nhosts: {hosts}\n", "inventory.yaml"))


PLAN = "[{host: h0, ps: 1, workers: 1}, {host: h1, workers: 2}, {host: h2, workers: [2400]}]"


def test_tf_config_per_task_holds_the_workers_only() -> None:
    configs = collective.tf_configs(plan_of(PLAN))
    cluster = {"worker": ["h0:2223", "h1:2222", "h1:2223", "h2:2400"]}
    assert configs == {f"worker:{i}": {"cluster": cluster, "task": {"type": "worker", "index": i}} for i in range(4)}


def test_a_copy_runs_the_program_through_dtf_runner_with_its_own_tf_config() -> None:
    plan = plan_of(PLAN)
    argv = collective.copy_argv(plan, plan.task("worker:2"), "~/.dtf/.cache/sync/abc/prog.py", ["--epochs", "2"], 3)
    assert argv[0] == "env" and argv[-5:] == ["-m", "dtf.program.runner", "~/.dtf/.cache/sync/abc/prog.py", "--epochs", "2"]
    env = dict(a.split("=", 1) for a in argv[1:argv.index("python3")])
    assert json.loads(env.pop("TF_CONFIG"))["task"] == {"type": "worker", "index": 2}
    assert env == {"TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1", "DTF_COLLECTIVE": "1", "DTF_CLUSTER": "c",
                   "DTF_ATTEMPT": "3", "DTF_SYNCED": "{}", "DTF_FIGURES": ".."}  # its task's dir: `dtf top`
    synced = collective.copy_argv(plan, plan.task("worker:2"), "p.py", [], 1, {"data": "../../.cache/sync/ab"})
    assert 'DTF_SYNCED={"data": "../../../.cache/sync/ab"}' in synced  # a copy works one level down


def test_output_is_prefixed_with_task_and_host() -> None:
    assert collective.prefix(plan_of(PLAN).task("worker:1")) == "[worker:1 h1] "


def test_ps_tasks_are_not_used_and_said_so() -> None:
    assert collective.check_plan(plan_of(PLAN)) == [
        "--collective: ps:0 (h0) not used (MultiWorkerMirroredStrategy has no parameter servers; they keep running)"]
    assert collective.check_plan(plan_of("[{host: a, workers: 2}]")) == []


def test_which_ends_are_worth_another_attempt_and_exit_codes() -> None:
    assert collective.lost_or_killed(follow.Ended("worker:1", -9, "killed by SIGKILL"))
    assert collective.lost_or_killed(follow.Ended("worker:1", None, "stopped"))
    assert collective.lost_or_killed(follow.Lost("worker:1", "no word"))
    assert not collective.lost_or_killed(follow.Ended("worker:1", 1, "exited with code 1"))
    assert [collective.exit_code(c) for c in (0, 3, -15, None)] == [0, 3, 143, 137]


def test_never_joined_names_each_task_and_why() -> None:
    plan = plan_of("[{host: h0, workers: 1}, {host: h1, workers: 1}, {host: h2, workers: 1}]")
    w = collective.workers(plan)
    assert collective.never_joined(plan, w, {"worker:0": True, "worker:2": True}, {"worker:2": ["h0", "h1"]}) == (
        "worker:0 (h0) waited for the others; "
        "worker:1 (h1) never listened on port 2222 (see `dtf logs worker:1`); "
        "worker:2 (h2) is not reachable at h2:2222 from h0, h1 (a firewall?)")


# -- GPUs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("ids", "workers", "expected"), [
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([0, 1, 2], 2, [[0, 1], [2]]),
    ([4, 5], 1, [[4, 5]]),
    ([0], 3, [[0], [0], [0]]),  # fewer GPUs than workers: shared (memory growth)
    ([0, 1], 3, [[0], [1], [0]]),
    ([], 2, [[], []]),
])
def test_gpu_shares(ids: list[int], workers: int, expected: list[list[int]]) -> None:
    assert gpus.shares(ids, workers) == expected


def test_gpu_env_of_tasks_from_the_inventory() -> None:
    plan = plan_of("[{host: a, ps: 1, workers: 2, gpus: 4}, {host: b, workers: 1, gpus: [3, 5]}, {host: c, workers: 1}]")
    argv = {t.name: t.serve_argv for t in plan.tasks()}
    assert argv["ps:0"][:3] == ("env", "CUDA_VISIBLE_DEVICES=", "TF_FORCE_GPU_ALLOW_GROWTH=true")
    assert argv["worker:0"][:3] == ("env", "CUDA_VISIBLE_DEVICES=0,1", "TF_FORCE_GPU_ALLOW_GROWTH=true")
    assert argv["worker:1"][1] == "CUDA_VISIBLE_DEVICES=2,3"
    assert argv["worker:2"][1] == "CUDA_VISIBLE_DEVICES=3,5"
    assert argv["worker:3"][0] != "env"  # no gpus key: TensorFlow's defaults
    copy = collective.copy_argv(plan, plan.task("worker:1"), "p.py", [], 1)
    assert "CUDA_VISIBLE_DEVICES=2,3" in copy and "TF_FORCE_GPU_ALLOW_GROWTH=true" in copy
    assert type(plan).from_dict(json.loads(json.dumps(plan.to_dict()))) == plan  # the record keeps it


def test_gpus_key_errors() -> None:
    from dtf.errors import InventoryError

    with pytest.raises(InventoryError, match=r"hosts\[0\]\.gpus: expected a number of GPUs"):
        loads("cluster: c\nhosts: [{host: a, workers: 1, gpus: [0, 0]}]\n", "inventory.yaml")


# -- the watch loop, with fake followers --------------------------------------------------------
def fake_run(monkeypatch: pytest.MonkeyPatch, script: dict[str, list[tuple[float, Any]]],
             join_timeout: float = 30.0, verbose: bool = False) -> tuple[collective.CollectiveRun, list[str]]:
    """A CollectiveRun on 3 workers whose followers put `script`'s events at their times; stop()
    ends every copy that has not ended (as TERM would) and is recorded."""
    plan = plan_of("[{host: h0, workers: 1}, {host: h1, workers: 1}, {host: h2, workers: 1}]")
    record = Record(plan=plan, inventory="i.yaml", created=0.0, chief_host="127.0.0.1")
    run = collective.CollectiveRun(record, __import__("pathlib").Path("p.py"), [], __import__("pathlib").Path("o"),
                                   join_timeout=join_timeout, grace=1.0, verbose=verbose)
    calls: list[str] = []
    stopped = threading.Event()

    def follow_task(plan: Any, task: Any, events: queue.Queue[Any], stop: threading.Event, *rest: Any) -> None:
        t0 = time.monotonic()
        for at, ev in script.get(task.name, []):
            while time.monotonic() - t0 < at and not stopped.is_set():
                time.sleep(0.01)
            if stopped.is_set():
                break
            events.put(ev)
            if isinstance(ev, follow.Ended):
                return
        stopped.wait(10)
        events.put(follow.Ended(task.name, -15, "killed by SIGTERM"))  # the copy's end after the stop

    def stop(what: str) -> dict[str, str]:
        calls.append("stop")
        stopped.set()
        return {}

    def diagnose(pending: list[Any]) -> tuple[str, bool]:
        calls.append("diagnose " + ",".join(t.name for t in pending))
        return "worker:2 (h2) is not reachable at h2:2222 from h0, h1 (a firewall?)", True

    monkeypatch.setattr(follow, "follow_task", follow_task)
    monkeypatch.setattr(run, "stop", stop)
    monkeypatch.setattr(run, "diagnose", diagnose)
    return run, calls


def test_the_first_failure_stops_every_copy_and_is_named(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    joined = [(0.0, follow.Joined(f"worker:{i}")) for i in range(3)]
    run, calls = fake_run(monkeypatch, {
        "worker:0": [joined[0], (0.05, follow.Line("worker:0", "epoch 0 done"))],
        "worker:1": [joined[1], (0.1, follow.Line("worker:1", "about to die")),
                     (0.2, follow.Ended("worker:1", -9, "killed by SIGKILL"))],
        "worker:2": [joined[2]],
    })
    result = run.watch(threading.Event())
    assert calls == ["stop"]
    assert result.failure == collective.Failure("worker:1", "h1", "killed by SIGKILL", ("about to die",), True)
    assert result.failure.describe() == "worker:1 (h1) failed first: killed by SIGKILL; last lines: about to die"
    assert result.chief_code == 143  # stopped with TERM
    out = capsys.readouterr()
    assert "[worker:0 h0] epoch 0 done\n" in out.out and "[worker:1 h1] about to die\n" in out.out


# As a copy's log holds them (TensorFlow 2.21, MultiWorkerMirroredStrategy on CPUs).
CHATTER = [
    "I0000 00:00:1795433291.552365   18585 cpu_feature_guard.cc:227] This TensorFlow binary is optimized "
    "to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
    "appropriate compiler flags.",
    "I0000 00:00:1795433299.401701   18585 generator_dataset_op.cc:213] Memory patch applied to the "
    "tf.data generator dataset",
    "W0000 00:00:1795433299.758108   21054 collective_ops.cc:412] collective op waits",
]


@pytest.mark.parametrize("verbose", [False, True])
def test_tensorflows_chatter_is_left_out_of_the_output_and_the_last_lines(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], verbose: bool) -> None:
    """As under `dtf train` (dtf.program.noise): a failed copy is quoted by its own lines, not TensorFlow's
    C++ INFO and WARNING lines; --verbose shows everything, as TensorFlow printed it."""
    joined = [(0.0, follow.Joined(f"worker:{i}")) for i in range(3)]
    lines = ["Epoch 1/3", CHATTER[0], CHATTER[1], "ValueError: the program's own error", *CHATTER[2:]]
    run, _ = fake_run(monkeypatch, {
        "worker:0": [joined[0]],
        "worker:1": [joined[1], *[(0.05, follow.Line("worker:1", text)) for text in lines],
                     (0.1, follow.Ended("worker:1", 1, "exited with code 1"))],
        "worker:2": [joined[2]],
    }, verbose=verbose)
    failure = run.watch(threading.Event()).failure
    out = capsys.readouterr().out
    assert failure is not None
    if verbose:
        assert failure.last_lines == tuple(lines[-5:])
        assert all(f"[worker:1 h1] {text}\n" in out for text in lines)
    else:
        assert failure.describe() == ("worker:1 (h1) failed first: exited with code 1; last lines: Epoch 1/3 | "
                                      "ValueError: the program's own error")
        assert out == "[worker:1 h1] Epoch 1/3\n[worker:1 h1] ValueError: the program's own error\n"


@pytest.mark.parametrize("heard_again", [False, True])
def test_a_failure_while_another_host_is_silent_names_that_host(monkeypatch: pytest.MonkeyPatch,
                                                                 heard_again: bool) -> None:
    """TensorFlow sees a host go (its heartbeats stop) before dtf's HOST_LOST does: the copy that
    fails then is not the culprit, the silent host is, unless it spoke again."""
    joined = [(0.0, follow.Joined(f"worker:{i}")) for i in range(3)]
    again = [(0.15, follow.Heard("worker:1"))] if heard_again else []
    run, calls = fake_run(monkeypatch, {
        "worker:0": [joined[0], (0.3, follow.Line("worker:0", "task:1 stopped sending heartbeats")),
                     (0.35, follow.Ended("worker:0", 1, "exited with code 1"))],
        "worker:1": [joined[1], (0.1, follow.Silent("worker:1", 6.0)), *again],
        "worker:2": [joined[2]],
    })
    failure = run.watch(threading.Event()).failure
    assert calls == ["stop"]
    if heard_again:
        assert failure == collective.Failure("worker:0", "h0", "exited with code 1",
                                             ("task:1 stopped sending heartbeats",), False)
    else:
        assert failure is not None and failure.describe() == (
            "worker:1 (h1) failed first: host lost: no word from h1 for 6s; then worker:0 (h0) exited with "
            "code 1; last lines: task:1 stopped sending heartbeats")
        assert failure.lost  # worth another attempt (--attempts)


def test_the_start_deadline_stops_all_and_names_who_never_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    run, calls = fake_run(monkeypatch, {"worker:0": [(0.0, follow.Joined("worker:0"))],
                                        "worker:1": [(0.0, follow.Joined("worker:1"))]}, join_timeout=0.5)
    with pytest.raises(collective.StartDeadline, match=r"start deadline \(0.5s, --join-timeout\) passed: "
                                                        r"worker:2 \(h2\) is not reachable"):
        run.watch(threading.Event())
    assert calls == ["diagnose worker:2", "stop"]


def test_ctrl_c_stops_every_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    run, calls = fake_run(monkeypatch, {f"worker:{i}": [(0.0, follow.Joined(f"worker:{i}"))] for i in range(3)})
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    result = run.watch(flag)
    assert result.interrupted and calls == ["stop"] and result.failure is None


def test_a_cluster_taken_down_stops_the_watch_not_the_copies(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`dtf down` stops the copies itself: the watch stops none, names no failure, and says why."""
    run, calls = fake_run(monkeypatch, {})
    asked = threading.Event()

    def taken_down() -> bool:
        asked.set()
        return True

    def follow_task(plan: Any, task: Any, events: queue.Queue[Any], stop: threading.Event, *rest: Any) -> None:
        events.put(follow.Joined(task.name))
        asked.wait(60)
        events.put(follow.Ended(task.name, -15, "killed by SIGTERM"))  # (`dtf down`'s stop)

    monkeypatch.setattr(follow, "follow_task", follow_task)
    run.taken_down = taken_down
    result = run.watch(threading.Event())
    assert result.taken_down and result.failure is None and calls == []
    assert "cluster 'c' is being taken down (`dtf down`)" in capsys.readouterr().err


def test_collective_imports_no_tensorflow() -> None:
    code = "import sys, dtf.collective.run, dtf.collective.follow; print('tensorflow' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_a_copys_last_output_is_read_even_when_its_exit_event_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locally the copy's stdout and its events (stderr) are two pipes, read by two threads: the
    exit event can be read before the output written ahead of it. The follower reads to the end."""
    plan = plan_of("[{host: h0, connection: local, workers: 1}]")
    script = ("import sys, time\n"
              "sys.stderr.write('dtf-exit {\"code\": 0, \"reason\": \"exited with code 0\"}\\n'); sys.stderr.flush()\n"
              "time.sleep(0.5)\n"
              "sys.stdout.write('the summary line\\nno newline'); sys.stdout.flush()\n")
    monkeypatch.setattr(follow, "follow_argv", lambda hp, task: [sys.executable, "-c", script])
    events: queue.Queue[Any] = queue.Queue()
    follow.follow_task(plan, plan.tasks()[0], events, threading.Event(), 10.0)
    seen = []
    while not events.empty():
        seen.append(events.get())
    assert seen == [follow.Line("worker:0", "the summary line"), follow.Line("worker:0", "no newline"),
                    follow.Ended("worker:0", 0, "exited with code 0")]
