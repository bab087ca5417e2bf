"""`dtf top`: a live view of every task of a cluster and of the training running on it.

`snapshot()` turns what the hosts pushed (dtf.hostops.watch) and what `dtf train` published
(dtf.program.figures) into plain data: one row per task, a summary, the training. `--json`
prints that document; `view()` lays it out for a terminal of a given size: trouble first,
grouped by host, one line per task, cut to the screen with a "... N more" line. `live()` refreshes
it every interval until `q` or Ctrl-C, in the terminal's alternate screen (restored on exit).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dtf.cluster.plan import Plan
from dtf.cluster.state import Record
from dtf.hostops.parallel import HostOps
from dtf.hostops.watch import HostFeed, Watch
from dtf.program import figures

SCHEMA = 1  # of `dtf top --json`: fields are only ever added; a change that would break a reader bumps it
TROUBLE = {"unknown": 0, "dead": 0, "failed": 0, "restarting": 1}  # else 2 (restarted before) or 3
STATE_STYLE = {"alive": "green", "restarting": "yellow"}


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def training(live: Path) -> dict[str, Any] | None:
    """What `dtf train` publishes while it runs (None: no run now)."""
    run = figures.read(live / figures.RUN)
    if run is None or not _alive(run.get("pid")):
        return None
    program = figures.read(live / figures.TRAIN)
    return training_doc(run, program if program is not None and _alive(program.get("pid")) else None)


def training_doc(run: dict[str, Any], program: dict[str, Any] | None, detached: str | None = None) -> dict[str, Any]:
    """The training's document from what `dtf train` (`run`) and its program publish
    (dtf.program.figures); `detached`: the host a detached run's coordinator runs on."""
    doc: dict[str, Any] = {"mode": run.get("kind"), "attempt": run.get("attempt"), "attempts": run.get("attempts"),
                           "last_retry": run.get("last_retry"), "waiting_for_ps": bool(run.get("waiting")),
                           "started": run.get("started"), "slurm_job": run.get("job"),
                           "reallocating": bool(run.get("reallocating")),
                           "network_lost_since": run.get("network_lost_since"), "detached_on": detached}
    if run.get("kind") == "collective":
        copies = run.get("copies") or {}
        doc["copies"] = copies
        doc["joined"] = sorted(name for name, c in copies.items() if c.get("joined"))
        return doc
    if program is not None:
        doc.update({k: program.get(k) for k in ("steps", "steps_per_s", "closures", "in_flight", "steps_per_closure",
                                                "packing", "last_failure", "retries", "resumed_at_step")})
        doc["workers"] = program.get("workers") or {}
    return doc


def detached_training(record: Record, ops: HostOps, timeout: float = 15.0) -> dict[str, Any] | None:
    """A detached run's document (dtf.detached; None: the cluster has none), asked of its
    coordinator's host: running (its figures), ended (its exit code), or unknown (its host did not
    answer: why)."""
    from dtf.detached.remote import ask_state, host_of
    from dtf.errors import DtfError
    from dtf.hosts.base import HostError

    d = record.detached
    if d is None:
        return None
    base: dict[str, Any] = {"mode": "ps", "detached_on": d.host, "program": d.program, "started": d.started}
    if d.ended:
        return {**base, "state": "ended", "exit_code": d.exit_code, "reason": d.reason, "fetched": d.fetched}
    try:
        reply = ask_state(ops, host_of(record.plan, d), timeout=timeout)
    except (HostError, DtfError) as e:
        return {**base, "state": "unknown", "error": str(e)}
    if reply.run_id != d.run_id or reply.state == "none":
        return {**base, "state": "unknown", "error": f"its files are gone from {d.host}"}
    if reply.state == "ended":
        return {**base, "state": "ended", "exit_code": reply.exit_code, "reason": reply.reason, "fetched": False}
    if reply.run is None:
        return {**base, "state": "starting"}
    return {**training_doc(reply.run, reply.run.get("train"), detached=d.host), "state": "running",
            "program": d.program}


def snapshot(plan: Plan, feeds: dict[str, HostFeed], train: dict[str, Any] | None,
             recovered: dict[str, str] | None = None) -> dict[str, Any]:
    """The document `--json` prints and the view shows; `recovered`: the record's note per task
    dtf brought back (restarted, moved to a spare)."""
    workers = (train or {}).get("workers") or {}
    rows = []
    for t in plan.tasks():
        feed = feeds.get(t.host, HostFeed())
        sample = feed.sample.tasks.get(t.name) if feed.sample is not None and feed.error is None else None
        row: dict[str, Any] = {"task": t.name, "job": t.job, "index": t.index, "host": t.host,
                               "state": "unknown", "restarts": 0, "last_exit": None, "uptime": None,
                               "cpu": None, "rss": None, "net_in": None, "net_out": None,
                               "steps_per_s": None, "recovered": (recovered or {}).get(t.name),
                               "error": feed.error or ("no sample yet" if sample is None else None)}
        if sample is not None:
            st = sample.status
            row.update(state=st.state, restarts=st.restarts, last_exit=st.last_exit, uptime=st.uptime,
                       cpu=sample.cpu, rss=sample.rss, net_in=sample.net_in, net_out=sample.net_out,
                       error=st.reason)
        if t.job == "worker" and str(t.index) in workers:
            row["steps_per_s"] = workers[str(t.index)].get("steps_per_s")
        if sample is not None and sample.train and train is not None and train.get("mode") == "collective":
            row["steps_per_s"] = sample.train.get("steps_per_s")  # the copy's own, from its host
            copy = (train.get("copies") or {}).get(t.name)
            if copy is not None:
                copy.update(steps=sample.train.get("steps"), steps_per_s=sample.train.get("steps_per_s"))
        rows.append(row)
    if train is not None and train.get("mode") == "collective":
        # The copies step together (each step is an all-reduce of them all): the run goes at the
        # pace of its slowest copy.
        rates = [r["steps_per_s"] for r in rows if r["job"] == "worker" and r["steps_per_s"] is not None]
        train["steps_per_s"] = round(min(rates), 2) if rates else None
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1

    def total(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) if values else None

    summary = {"tasks": len(rows), "hosts": len(plan.hosts), "states": states, "cpu": total("cpu"),
               "rss": total("rss"), "net_in": total("net_in"), "net_out": total("net_out")}
    return {"schema": SCHEMA, "cluster": plan.cluster, "time": time.time(), "summary": summary,
            "training": train, "tasks": rows}


def trouble(row: dict[str, Any]) -> int:
    """0 worst: a task not running or not known, then restarting, then restarted before, then well."""
    return TROUBLE.get(row["state"], 2 if row["restarts"] else 3)


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trouble first; within the same trouble, grouped by host (in the inventory's order), ps first."""
    hosts = list(dict.fromkeys(r["host"] for r in rows))
    return sorted(rows, key=lambda r: (trouble(r), hosts.index(r["host"]), r["job"] != "ps", r["index"]))


def size(n: float | None, per_second: bool = False) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            text = f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
            return text + ("/s" if per_second else "")
        n /= 1024
    return "-"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def summary_line(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    states = ", ".join(f"{n} {name}" for name, n in sorted(s["states"].items(), key=lambda kv: TROUBLE.get(kv[0], 9)))
    cpu = "-" if s["cpu"] is None else f"{s['cpu']:.0f}%"
    return (f"cluster {doc['cluster']}: {s['tasks']} tasks on {s['hosts']} host{'s' if s['hosts'] != 1 else ''}: "
            f"{states} | cpu {cpu} "
            f"mem {size(s['rss'])} net in {size(s['net_in'], True)} out {size(s['net_out'], True)}")


def training_lines(train: dict[str, Any] | None) -> list[str]:
    if train is None:
        return ["training: none (no `dtf train` running)"]
    state = train.get("state")
    if state in ("ended", "unknown", "starting"):  # a detached run (detached_training)
        where = f"training ({train['program']}, detached on {train['detached_on']})"
        if state == "ended":
            how = train.get("reason") or f"exited with code {train.get('exit_code')}"
            fetched = "its outputs fetched" if train.get("fetched") else "`dtf attach` brings its outputs"
            return [f"{where}: ended, {how} ({fetched})"]
        if state == "starting":
            return [f"{where}: starting"]
        return [f"{where}: unknown ({train.get('error')})"]
    head = f"training ({train['mode']}): attempt {train['attempt']} of {train['attempts']}"
    if train.get("detached_on"):  # `dtf train --detach`: its coordinator runs on a host of the cluster
        head += f", detached on {train['detached_on']}"
    if train.get("slurm_job"):  # the allocation it runs on (a new one after an ended job)
        head += f" on slurm job {train['slurm_job']}"
    if train.get("reallocating"):
        head += ", waiting for a new Slurm allocation"
    if train.get("waiting_for_ps"):
        head += ", waiting for the ps to serve again"
    if train.get("network_lost_since"):
        head += f", waiting for the network since {train['network_lost_since']}"
    if train.get("resumed_at_step"):
        head += f", resumed at step {train['resumed_at_step']}"
    if train["mode"] == "collective":
        copies = train.get("copies") or {}
        parts = [f"{name} {c.get('state')}" + (f" {c['steps_per_s']:.1f} steps/s" if c.get("steps_per_s") is not None
                                               else "") for name, c in sorted(copies.items())]
        rate = f", {train['steps_per_s']:.1f} steps/s (the slowest copy's)" if train.get("steps_per_s") is not None \
            else ""
        return [head + f" | {len(train['joined'])} of {len(copies)} copies joined{rate}",
                "copies: " + (", ".join(parts) or "starting")]
    if train.get("steps") is None:
        return [head + " | the program has scheduled nothing yet", _last(train)]
    packing = train.get("steps_per_closure")
    who = {"dtf": "chosen by dtf", "program": "the program's"}.get(str(train.get("packing")), "")
    return [head + f" | {train['steps_per_s']:.1f} steps/s, {train['steps']} steps, "
            f"{train['in_flight'] if train['in_flight'] is not None else '-'} closures in flight, "
            f"{packing} steps per closure{' (' + who + ')' if who else ''}", _last(train)]


def _last(train: dict[str, Any]) -> str:
    retry, failure = train.get("last_retry"), train.get("last_failure")
    if not retry and not failure:
        return "no failure or retry"
    return " | ".join(filter(None, [f"last retry: {retry}" if retry else None,
                                    f"last failure: {failure}" if failure else None]))


def view(doc: dict[str, Any], height: int) -> RenderableType:
    """The screen: summary, training, then one line per task, trouble first, grouped by host (its
    name on the first line of each run of its tasks); when
    the tasks do not fit in `height` lines, as many as fit and "... N more (K in trouble)"."""
    rows = ordered(doc["tasks"])
    head = [summary_line(doc), *training_lines(doc["training"])]
    room = max(1, height - len(head) - 2)  # the table's header, the "... N more" line
    shown, hidden = (rows, []) if len(rows) <= room + 1 else (rows[:room], rows[room:])
    tab = Table(box=None, show_edge=False, pad_edge=False, header_style="bold")
    for col, justify in (("host", "left"), ("task", "left"), ("state", "left"), ("restarts", "right"),
                         ("last exit", "left"), ("uptime", "right"), ("cpu", "right"), ("mem", "right"),
                         ("net in", "right"), ("net out", "right"), ("steps/s", "right")):
        tab.add_column(col, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    previous = None
    for r in shown:
        style = STATE_STYLE.get(r["state"], "red")
        state = r["state"] if not r["error"] or r["state"] == "alive" else f"{r['state']}: {r['error']}"
        if r.get("recovered"):  # "restarted by dtf", "moved from h1 to spare h2"
            state += f" ({r['recovered'].split(' at ')[0]})"
        tab.add_row(r["host"] if r["host"] != previous else "", r["task"], Text(state, style=style),
                    str(r["restarts"]), r["last_exit"] or "-", duration(r["uptime"]),
                    "-" if r["cpu"] is None else f"{r['cpu']:.0f}%", size(r["rss"]),
                    size(r["net_in"], True), size(r["net_out"], True),
                    "-" if r["steps_per_s"] is None else f"{r['steps_per_s']:.1f}")
        previous = r["host"]
    parts: list[RenderableType] = [Text(line, no_wrap=True, overflow="ellipsis") for line in head]
    parts.append(tab)
    if hidden:
        bad = sum(1 for r in hidden if trouble(r) < 2)
        parts.append(Text(f"... {len(hidden)} more" + (f" ({bad} in trouble)" if bad else ""), no_wrap=True))
    return Group(*parts)


@contextlib.contextmanager
def keys() -> Iterator[None]:
    """The terminal in cbreak mode (a key reaches us without Enter, Ctrl-C still interrupts),
    restored on the way out."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def pressed(timeout: float) -> str | None:
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout))
    return os.read(sys.stdin.fileno(), 32).decode(errors="replace") if ready else None


def live(record: Record, watch: Watch, trained: Callable[[], dict[str, Any] | None], interval: float,
         console: Console,
         recorded: Callable[[], Record | None] = lambda: None,
         watch_for: Callable[[Plan], Watch] | None = None) -> None:
    """Refresh every `interval` s until `q` (or Ctrl-C). The record is read again at each refresh
    (`recorded`): where tasks moved to a spare, the view watches the new placement (`watch_for`)."""
    shown_record, current = record, watch

    def screen() -> RenderableType:
        nonlocal shown_record, current
        now = recorded()
        if now is not None and now.created == shown_record.created:
            if now.plan != shown_record.plan and watch_for is not None:
                if current is not watch:
                    current.__exit__(None, None, None)
                current = watch_for(now.plan).__enter__()
            shown_record = now
        doc = snapshot(shown_record.plan, current.feeds(), trained(), shown_record.recovered)
        return Group(view(doc, console.size.height - 1), Text("q: quit", style="dim"))

    with keys(), Live(screen(), console=console, screen=True, auto_refresh=False) as shown, \
            contextlib.suppress(KeyboardInterrupt), contextlib.ExitStack() as later:
        later.callback(lambda: current.__exit__(None, None, None) if current is not watch else None)
        next_at = time.monotonic()
        while True:
            key = pressed(next_at - time.monotonic())
            if key is not None and "q" in key.lower():
                return
            if time.monotonic() >= next_at:
                shown.update(screen(), refresh=True)
                next_at = time.monotonic() + interval
