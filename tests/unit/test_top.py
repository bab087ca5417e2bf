"""`dtf top`'s pieces without a cluster: the view's layout (100 tasks fit a screen, trouble
first, grouped by host), the --json document, the training figures (published at most once a
second, atomically; steps/s per worker), and the launcher's sample of a process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from dtf import top
from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.hostops.watch import HostFeed
from dtf.program import figures
from dtf_server import sample
from dtf_server.protocol import TaskSample, TaskStatus, TopSample, decode, encode


def plan_of(tmp_path: Path, hosts: int, workers: int):
    lines = ["cluster: big", "hosts:"]
    for h in range(hosts):
        lines.append(f"  - {{host: h{h:02d}, ps: {1 if h == 0 else 0}, workers: {workers}}}")
    return make_plan(loads("\n".join(lines) + "\n", "inv.yaml"), resolve=lambda spec: spec.host, server="fake")


def alive(uptime: float = 60.0, restarts: int = 0) -> TaskStatus:
    return TaskStatus(alive=True, phase="running", pid=10, server_pid=11, uptime=uptime, serving=True,
                      restarts=restarts, last_exit="killed by SIGKILL" if restarts else None)


def feeds_for(plan, trouble: dict[str, TaskStatus], silent: str | None = None) -> dict[str, HostFeed]:
    feeds = {}
    for hp in plan.hosts:
        if hp.name == silent:
            feeds[hp.name] = HostFeed(error="no word from h for 10s")
            continue
        tasks = {t.name: TaskSample(trouble.get(t.name, alive()), cpu=50.0, rss=100 << 20, net_in=2048.0,
                                    net_out=1024.0) for t in hp.tasks}
        feeds[hp.name] = HostFeed(sample=TopSample(tasks=tasks, time=time.time()), samples=2, connects=1)
    return feeds


def screen(doc: dict, width: int = 160, height: int = 40) -> list[str]:
    console = Console(width=width, height=height, record=True, file=open(os.devnull, "w"))
    console.print(top.view(doc, height))
    return console.export_text().rstrip("\n").splitlines()


def test_100_tasks_fit_the_screen_trouble_first_grouped_by_host(tmp_path: Path):
    plan = plan_of(tmp_path, hosts=33, workers=3)  # 1 ps + 99 workers on 33 hosts
    assert len(plan.tasks()) == 100
    trouble = {"worker:50": TaskStatus.dead("supervisor is gone"), "worker:7": alive(restarts=2),
               "worker:90": TaskStatus(alive=True, phase="restarting", pid=1, server_pid=None, uptime=None,
                                       serving=False, restarts=1)}
    doc = top.snapshot(plan, feeds_for(plan, trouble, silent="h20"), None)
    lines = screen(doc, height=30)
    assert len(lines) <= 30, lines
    assert lines[0].startswith("cluster big: 100 tasks on 33 hosts: ")
    assert "3 unknown" in lines[0] and "1 dead" in lines[0] and "1 restarting" in lines[0] and "95 alive" in lines[0]
    assert lines[1] == "training: none (no `dtf train` running)"
    assert lines[2].split()[:3] == ["host", "task", "state"]
    body = lines[3:]
    # The silent host's tasks (unknown) and the dead one first, then restarting, then restarted.
    firsts = [line.split()[1] if not line.startswith(" ") else line.split()[0] for line in body[:6]]
    assert set(firsts[:4]) == {"worker:50", "worker:60", "worker:61", "worker:62"}, body[:6]
    assert firsts[4] == "worker:90" and firsts[5] == "worker:7", body[:6]
    assert "no word from h for 10s" in "\n".join(body[:4])
    # The host is named once per group.
    assert [line.split()[0] for line in body[:4]] == ["h16", "h20", "worker:61", "worker:62"]
    assert lines[-1].startswith("... ") and lines[-1].endswith(" more"), lines[-1]
    shown = sum(1 for line in body if ":" in line and not line.startswith("..."))
    assert shown + int(lines[-1].split()[1]) == 100


def test_everything_shown_when_it_fits(tmp_path: Path):
    plan = plan_of(tmp_path, hosts=2, workers=2)
    doc = top.snapshot(plan, feeds_for(plan, {}), None)
    lines = screen(doc, height=40)
    assert not any(line.startswith("...") for line in lines)
    assert sum(1 for line in lines[3:] if "alive" in line.split()) == 5
    assert "50%" in lines[3] and "100.0M" in lines[3] and "2.0K/s" in lines[3]


def test_json_document(tmp_path: Path):
    plan = plan_of(tmp_path, hosts=2, workers=2)
    train = {"mode": "ps", "attempt": 1, "attempts": 3, "last_retry": None, "waiting_for_ps": False,
             "started": 0.0, "steps": 500, "steps_per_s": 120.5, "closures": 50, "in_flight": 4,
             "steps_per_closure": 10, "packing": "dtf", "last_failure": None, "retries": 0,
             "workers": {"0": {"steps": 300, "steps_per_s": 70.0}, "2": {"steps": 200, "steps_per_s": 50.5}}}
    doc = json.loads(json.dumps(top.snapshot(plan, feeds_for(plan, {}), train)))
    assert (doc["schema"], doc["cluster"]) == (1, "big")
    assert doc["summary"] == {"tasks": 5, "hosts": 2, "states": {"alive": 5}, "cpu": 250.0,
                              "rss": 5 * (100 << 20), "net_in": 5 * 2048.0, "net_out": 5 * 1024.0}
    rows = {r["task"]: r for r in doc["tasks"]}
    assert set(rows["ps:0"]) == {"task", "job", "index", "host", "state", "restarts", "last_exit", "uptime",
                                 "cpu", "rss", "net_in", "net_out", "steps_per_s", "error", "recovered"}
    assert (rows["worker:0"]["steps_per_s"], rows["worker:1"]["steps_per_s"], rows["worker:2"]["steps_per_s"]) \
        == (70.0, None, 50.5)
    assert doc["training"]["steps_per_s"] == 120.5
    text = "\n".join(screen(top.snapshot(plan, feeds_for(plan, {}), train)))
    assert "training (ps): attempt 1 of 3 | 120.5 steps/s, 500 steps, 4 closures in flight, 10 steps per " \
           "closure (chosen by dtf)" in text


def test_figures_rates_per_worker_and_atomic_file(tmp_path: Path):
    now = [100.0]
    f = figures.Figures(tmp_path / "live" / figures.TRAIN, attempt=2, clock=lambda: now[0])
    f.in_flight = lambda: 3
    f.publish()
    for _ in range(10):
        f.closure_done(0, 5, 0.25)
    f.closure_done(1, 5, 0.5)
    f.closure_done(1, 1, 0.125, told=False)  # one of evaluate()'s shards: 1 step counted
    now[0] += 2.0
    f.publish()
    doc = figures.read(tmp_path / "live" / figures.TRAIN)
    assert doc is not None
    assert (doc["steps"], doc["closures"], doc["attempt"], doc["in_flight"]) == (56, 12, 2, 3)
    assert doc["workers"] == {
        "0": {"steps": 50, "steps_per_s": 25.0, "closures": 10, "closures_of_unknown_steps": 0, "busy_s": 2.5},
        "1": {"steps": 6, "steps_per_s": 3.0, "closures": 2, "closures_of_unknown_steps": 1, "busy_s": 0.625}}
    assert doc["steps_per_s"] == 28.0
    assert [p.name for p in (tmp_path / "live").iterdir()] == [figures.TRAIN]  # no temporary file left


def test_training_shown_only_while_dtf_train_runs(tmp_path: Path):
    live = tmp_path / "live"
    live.mkdir()
    figures.write_atomic(live / figures.RUN, {"schema": 1, "kind": "collective", "pid": os.getpid(), "attempt": 2,
                                              "attempts": 3, "last_retry": "worker:1 (h1) failed first",
                                              "copies": {"worker:0": {"joined": True, "state": "running"},
                                                         "worker:1": {"joined": False, "state": "starting"}}})
    train = top.training(live)
    assert train is not None and train["joined"] == ["worker:0"]
    assert top.training_lines(train)[0] == "training (collective): attempt 2 of 3 | 1 of 2 copies joined"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    figures.write_atomic(live / figures.RUN, {"schema": 1, "kind": "ps", "pid": int(gone.stdout)})
    assert top.training(live) is None  # that dtf train is gone


def test_sample_of_a_process_group_and_the_stream_line():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<30: pass"],
                            start_new_session=True)
    try:
        first = sample.usage({"t": busy.pid})["t"]
        deadline = time.monotonic() + 20
        while True:  # wait for the event (CPU time accounted), not for a time
            second = sample.usage({"t": busy.pid})["t"]
            if second.cpu_ticks > first.cpu_ticks or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        cpu, _, _ = sample.rates(first, second, 1.0)
        assert cpu is not None and cpu > 0 and second.rss > 0
    finally:
        busy.kill()
        busy.wait()
    assert sample.rates(None, second, 1.0) == (None, None, None)
    line = encode(TopSample(tasks={"ps:0": TaskSample(alive(), cpu=12.5, rss=1, net_in=None, net_out=2.0)},
                            time=1.0, lease=None))
    back = decode(TopSample, line)
    assert back.tasks["ps:0"].status.state == "alive" and back.tasks["ps:0"].cpu == 12.5


def test_dtf_trains_own_figures_live_while_it_runs(tmp_path: Path, monkeypatch):
    from dtf.program.train import RunFigures

    monkeypatch.setenv("DTF_HOME", str(tmp_path))
    live = figures.live_dir(tmp_path, "c")
    (live).mkdir(parents=True)
    (live / figures.TRAIN).write_text("{}")  # a previous run's: not shown as this one's
    with RunFigures("c", attempts=3, mode="collective") as run:
        assert not (live / figures.TRAIN).exists()
        run.update(attempt=2, copies={"worker:0": {"host": "h0", "joined": True, "state": "running"}})
        train = top.training(live)
        assert train is not None
        assert (train["mode"], train["attempt"], train["attempts"], train["joined"]) == ("collective", 2, 3, ["worker:0"])
    assert not live.exists()


def test_the_programs_figures_end_with_it_and_the_run_leaves_nothing(tmp_path: Path, monkeypatch):
    """The program's publisher is a daemon thread: at the program's exit it is stopped and joined
    before the last write (else the interpreter can cut it between a write and its rename, leaving
    the temporary file), and the run's end removes any such file a killed program left."""
    from dtf.program.train import RunFigures

    monkeypatch.setenv("DTF_HOME", str(tmp_path))
    live = figures.live_dir(tmp_path, "c")
    with RunFigures("c", attempts=1):
        program = ("import time; from dtf.program import figures\n"
                   "f = figures.current(); f.closure_done(0, 7)\n"
                   "while not (figures.current().path.exists()): time.sleep(0.01)\n")
        env = {**os.environ, figures.ENV: str(live)}
        subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=60)
        assert sorted(p.name for p in live.iterdir()) == [figures.RUN, figures.TRAIN]  # no temporary file
        assert json.loads((live / figures.TRAIN).read_text())["steps"] == 7  # the last figures, at exit
        (live / f".{figures.TRAIN}.999.tmp").write_text("{")  # a program killed mid-write
    assert not live.exists()


def test_collective_copies_steps_from_their_hosts(tmp_path: Path):
    plan = plan_of(tmp_path, hosts=2, workers=1)
    feeds = feeds_for(plan, {})
    for name, rate in (("h00", 40.0), ("h01", 38.5)):
        s = feeds[name].sample
        assert s is not None
        worker = next(n for n in s.tasks if n.startswith("worker"))
        tasks = {**s.tasks, worker: TaskSample(alive(), cpu=1.0, train={"steps": 100, "steps_per_s": rate})}
        feeds[name] = HostFeed(sample=TopSample(tasks=tasks, time=s.time), samples=2)
    train = {"mode": "collective", "attempt": 1, "attempts": 3, "joined": ["worker:0", "worker:1"],
             "copies": {"worker:0": {"joined": True, "state": "running"}, "worker:1": {"joined": True, "state": "running"}}}
    doc = top.snapshot(plan, feeds, train)
    assert {r["task"]: r["steps_per_s"] for r in doc["tasks"]} == {"ps:0": None, "worker:0": 40.0, "worker:1": 38.5}
    assert doc["training"]["steps_per_s"] == 38.5  # the copies step together: the slowest one's pace
    assert top.training_lines(doc["training"]) == [
        "training (collective): attempt 1 of 3 | 2 of 2 copies joined, 38.5 steps/s (the slowest copy's)",
        "copies: worker:0 running 40.0 steps/s, worker:1 running 38.5 steps/s"]


def test_the_launchers_top_stream_ends_with_its_reader_not_at_its_next_sample(tmp_path: Path):
    """A `top` stream whose reader goes (the SSH channel closed at the end of `dtf train` or `dtf
    top`) ends then, and its record with it: not at the next sample's write, an interval later."""
    code = "import sys; from dtf_server.commands import main; main()"
    stream = subprocess.Popen([sys.executable, "-c", code, "top", "--dir", str(tmp_path), "--task", "worker:0",
                               "--interval", "3600", "--states-only"], stdout=subprocess.PIPE)
    assert stream.stdout is not None
    line = stream.stdout.readline()
    assert decode(TopSample, line.decode()).tasks["worker:0"].status.alive is False
    assert [p.name for p in tmp_path.glob("top-*.json")] == [f"top-{stream.pid}.json"]
    stream.stdout.close()  # its reader gone, an hour before its next sample
    assert stream.wait(timeout=60) == 0
    assert list(tmp_path.glob("top-*.json")) == []
