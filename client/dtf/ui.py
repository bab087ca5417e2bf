"""How dtf looks in a terminal: per-host progress, summary tables, one-line errors.

rich prints what needs it (tables, the live view, styled lines, JSON); a plain line is written
as it is (`say`). rich is imported where it prints, not by every command.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import sys
import time
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from dtf.hosts.shell import render

if TYPE_CHECKING:  # annotations only: every dtf command imports this module, few need these
    from rich.console import Console
    from rich.table import Table

    from dtf.cluster.inventory import Inventory
    from dtf.cluster.plan import Plan
    from dtf.cluster.state import Record
    from dtf.files.sync import Pack
    from dtf.hostops.lifecycle import UpResult
    from dtf.hostops.parallel import Outcome, Progress
    from dtf.hostops.start import HostStarted
    from dtf.hostops.status import TaskState
    from dtf.hostops.stop import HostStopped
    from dtf.program.figures import Shares
    from dtf.providers.provider import AllocationReport

# The version of `dtf status --json`'s document (docs/watching.md): fields may be added; a change that would
# break a reader bumps it.
STATUS_SCHEMA = 1



def say(line: str, stderr: bool = False) -> None:
    """One plain line on stdout (or stderr), as it is: no markup, no wrapping."""
    stream = sys.stderr if stderr else sys.stdout
    stream.write(line + "\n")
    stream.flush()


@functools.cache
def console(stderr: bool = False) -> Console:
    """rich's Console for stdout (or stderr), made at its first use. It looks the stream up at
    each print: rich's live view replaces it while it shows, and tests capture it."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True, emoji=False)


def escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def error(lines: list[str]) -> None:
    first, *rest = lines
    console(stderr=True).print(f"[bold red]dtf: error:[/] {escape(first)}")  # values may hold [brackets]
    for line in rest:
        say(line, stderr=True)


# The live view of a step on many hosts: a row per host up to this many hosts, else a row per step
# (a hundred rows fit no terminal, and rich redrawing them several times a second costs CPU).
ROWS_PER_HOST_UP_TO = 20
NAMED_PER_STEP = 4


def progress_table(title: str, steps: dict[str, str], seconds: float) -> Table:
    """host_progress's live view: each host's step, or for more than ROWS_PER_HOST_UP_TO hosts
    each step's hosts (how many, the first few named): failed steps first, then those under way,
    then done."""
    from rich.table import Table

    def styled(step: str) -> str:
        style = "red" if step.startswith("failed") else "green" if step == "done" else ""
        return f"[{style}]{escape(step)}[/]" if style else escape(step)

    tab = Table(title=title, title_justify="left", show_edge=False, box=None)
    if len(steps) <= ROWS_PER_HOST_UP_TO:
        tab.add_column("host", style="bold")
        tab.add_column("step")
        for h, s in steps.items():
            tab.add_row(escape(h), styled(s))
    else:
        tab.add_column("hosts", style="bold", justify="right")
        tab.add_column("step")
        at: dict[str, list[str]] = {}
        for h, s in steps.items():
            at.setdefault(s, []).append(h)
        for s, names in sorted(at.items(), key=lambda kv: (not kv[0].startswith("failed"), kv[0] == "done")):
            some = ", ".join(names[:NAMED_PER_STEP]) + (f" and {len(names) - NAMED_PER_STEP} more"
                                                        if len(names) > NAMED_PER_STEP else "")
            tab.add_row(str(len(names)), f"{styled(s)} [dim]({escape(some)})[/]")
    tab.caption = f"{seconds:.1f}s"
    return tab


@contextlib.contextmanager
def host_progress(hosts: list[str], title: str) -> Iterator[Progress]:
    """A live table (one row per host, its current step) on a terminal; one line per step
    elsewhere (CI logs, pipes)."""
    steps = {h: "waiting" for h in hosts}
    t0 = time.monotonic()

    def table() -> Table:
        return progress_table(title, steps, time.monotonic() - t0)

    if console(stderr=True).is_terminal:
        from rich.live import Live

        # Once every host is done the view goes: the command's own output (up's table on stdout)
        # says the rest, and a view left above it repeats it with a title and a time of its own.
        # A step that failed stays on screen: the error lines below it name the host.
        with Live(table(), console=console(stderr=True), refresh_per_second=8, transient=True) as live:
            def update(host: str, step: str) -> None:
                steps[host] = step
                live.update(table())
            try:
                yield update
            except BaseException:
                live.transient = False
                raise
            live.transient = not any(step.startswith("failed") for step in steps.values())
    else:
        def update(host: str, step: str) -> None:
            if steps.get(host) != step:  # a step said again (several callers end a host) is one line
                steps[host] = step
                say(f"  {host}: {step}", stderr=True)
        try:
            yield update
        finally:
            # Every step is written before what the command prints next (on stdout, or its error): in a
            # pipe or file that holds both, the steps come first.
            sys.stderr.flush()


def show_plan(plan: Plan) -> None:
    say(f"cluster {plan.cluster} (from {plan.inventory}): {len(plan.hosts)} host(s), "
        f"{len(plan.tasks())} task(s)")
    for hp in plan.hosts:
        target = "local processes" if hp.spec.local else "ssh " + " ".join(
            filter(None, [f"-l {hp.spec.user}" if hp.spec.user else "",
                          f"-p {hp.spec.port}" if hp.spec.port else "",
                          f"-i {hp.spec.identity_file}" if hp.spec.identity_file else "", hp.spec.host]))
        say(f"\nhost {hp.name} ({target})")
        say(f"  upload   {hp.launcher}")
        say(f"  check    {render(hp.check_argv())}")
        if hp.env_dir is not None:
            say(f"  env      {hp.env_dir} on {hp.base_python}, unless complete there: "
                + ", ".join(hp.requirements))
        say(f"  start    {render(hp.start_argv)}")
        for t in hp.tasks:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in hp.env)
            say(f"  {t.name:<10} {t.address:<24} {env} {render(t.serve_argv)}")
            say(f"  {'':<10} log {t.log}")
    for sp in plan.spares:
        say(f"\nspare {sp.name}: checked at `up` ({render(sp.check_argv())}), then left alone; takes the "
            f"tasks of a host unanswered for {plan.host_timeout:g}s under `dtf train`")
    for item in plan.sync:
        say(f"\nsync     {item.path} to every host as {item.name!r} (WORKDIR/.cache/sync/HASH; "
            f"skipped where a host has it)")
    say("\nTF_CONFIG cluster (the chief is added by `dtf train`): "
        + json.dumps(plan.cluster_spec()))
    from dtf.providers import route

    say(route.network_line(plan))
    say(firewall_plan(plan))


def show_request(inv: Inventory) -> bool:
    """--dry-run of an inventory whose hosts a scheduler lends: what `up` asks for, and the task
    layout (there is no plan before the allocation). False for an inventory's own hosts."""
    from dtf.providers.choose import request_lines

    lines = request_lines(inv)
    for line in lines or ():
        say(line)
    return lines is not None


def firewall_plan(plan: Plan) -> str:
    """Who may connect to the TF ports, as `up` will set it (for --dry-run)."""
    if plan.firewall == "off":
        return "firewall: off: the TF ports accept connections from anyone who reaches them"
    from dtf.providers import route

    laptop = route.laptop_let_in(plan)
    refused = "`up` refuses the host" if plan.firewall == "members" else "`up` goes on and says so"
    return (f"firewall: {plan.firewall}: on each host, before its servers start, the TF ports accept "
            f"connections only from {', '.join(plan.members())}, loopback"
            + (" and this machine's address as the host sees it" if laptop else "")
            + f" (needs root or passwordless sudo for nft or iptables there, else {refused})")


def open_hosts(outcomes: dict[str, Outcome[HostStarted]]) -> dict[str, str]:
    """The hosts whose start could not close their TF ports (`firewall: auto`), with the reason."""
    return {h: o.value.firewall.error for h, o in outcomes.items()
            if o.ok and o.value.firewall is not None and o.value.firewall.error}


def open_warning(plan: Plan, unclosed: dict[str, str]) -> str:
    """`firewall: auto` where hosts did not let dtf close their TF ports: one line for the cluster."""
    first = next(iter(unclosed))
    local = {hp.name for hp in plan.hosts if hp.spec.local}
    where = ("on this machine" if set(unclosed) <= local
             else "on " + ", ".join(unclosed))
    return (f"firewall: auto could not close the TF ports {where} ({first}: {unclosed[first]}): anyone who "
            f"reaches them can run code there; root or passwordless sudo for nft or iptables closes them, "
            f"firewall: members refuses such hosts")


def exposure(record: Record, unclosed: Collection[str] = ()) -> str:
    """Whether the TF ports are open to the network this machine sees: what `up` reports
    (`unclosed`: the hosts whose ports `firewall: auto` could not close)."""
    plan = record.plan
    closed = plan.firewall != "off" and not unclosed
    if not plan.remote_hosts:
        if closed:
            return f"TF ports on this machine: closed to other machines (firewall: {plan.firewall})"
        return "TF ports on this machine: any local user and your network can run code in them"
    if plan.firewall == "off":
        hint = "anyone who reaches them can run code on the hosts (firewall: off)"
    elif unclosed:
        hint = f"closed to non-members (firewall: {plan.firewall}) except on {', '.join(unclosed)}"
    else:
        hint = f"closed to non-members (firewall: {plan.firewall})"
    if record.tf_ports_open:
        return f"network: {record.network}; the TF ports accept connections from this machine; {hint}"
    return f"network: {record.network}; the TF ports are closed to this machine: dtf reaches them through SSH; {hint}"


def columns(headers: list[str], rows: list[list[str]]) -> str:
    """A plain table: each column as wide as its widest cell, two spaces apart (`up`'s cluster,
    which a script may read, and which has a row per task however many)."""
    widths = [max(len(row[i]) for row in (headers, *rows)) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (headers, *rows))


def show_up(plan: Plan, outcomes: dict[str, Outcome[HostStarted]], seconds: float) -> None:
    # pid: the server's, as in `dtf status` (the process that serves, and that `top` on the host shows)
    rows = [[t.name, t.host, t.address, str(outcomes[t.host].value.server_pids.get(t.name, "-")),
             f"{outcomes[t.host].seconds:.1f}s"] for t in plan.tasks()]
    say(f"cluster {plan.cluster} is up ({seconds:.1f}s)")
    say(columns(["task", "host", "address", "pid", "host ready in"], rows))
    for hp in plan.hosts:
        env = outcomes[hp.name].value.env
        if env is not None:
            from dtf.hostops.environments import env_summary

            say(f"{hp.name}: managed environment {env.dir}: {env_summary(env)}")


def show_purged(outcomes: dict[str, Outcome[HostStopped]]) -> None:
    """What `dtf down --purge` removed on each host (or why not)."""
    for host, o in outcomes.items():
        purged = o.value.purged if o.ok else None
        if purged is None:
            continue
        if purged.error:
            say(f"{host}: {purged.error}", stderr=True)
        else:
            say(f"{host}: cache removed ({purged.size / 1e6:.0f} MB freed)")


def show_packs(packs: list[Pack]) -> None:
    """Before a sync: a warning for a large one (naming its largest files), and what is left out."""
    from dtf.files.sync import large_warning

    for p in packs:
        warning = large_warning(p)
        if warning:
            console(stderr=True).print(f"[yellow]dtf: warning:[/] {escape(warning)}")
        for skipped in p.skipped:
            say(f"dtf: {p.name}: not sent: {skipped}", stderr=True)


def show_up_result(result: UpResult) -> None:
    """What `dtf up` did: the started cluster's table, the tasks it restarted, or nothing."""
    cluster = result.record.cluster
    unclosed = open_hosts(result.outcomes)
    if unclosed:
        console(stderr=True).print(f"[yellow]dtf: warning:[/] {escape(open_warning(result.record.plan, unclosed))}")
    if result.started:
        show_up(result.record.plan, result.outcomes, result.seconds)
        say(exposure(result.record, unclosed))
    elif result.restarted:
        restarted = ", ".join(f"{task} (was {was})" for task, was in result.restarted)
        say(f"cluster {cluster}: restarted {restarted} in {result.seconds:.1f}s; "
            f"{result.serving} task(s) kept running")
    else:
        lease = f"; idle timeout now {result.new_ttl:g}s" if result.new_ttl is not None else ""
        say(f"cluster {cluster} is already up: {result.serving} tasks serving{lease}")
    for report in result.synced:
        say(report.line())
    for host, why in result.retired.items():
        console(stderr=True).print(f"[yellow]dtf: warning:[/] {escape(retired_line(host, why))}")


def retired_line(host: str, why: str) -> str:
    """A host whose tasks moved to a spare, whose old tasks could not be stopped now."""
    return (f"{host} (its tasks moved to a spare) cannot be reached to stop what it still runs ({why}): kept "
            f"in the record; `dtf up` and `dtf down` try again, and its old tasks stop themselves once their "
            f"lease lapses")


def status_rows(states: list[TaskState], recovered: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per task: what `dtf status` shows, and the schema of `dtf status --json` (docs/watching.md).
    `recovered`: the record's note per task dtf brought back (restarted, moved to a spare)."""
    rows = []
    for st in states:
        t, info = st.task, st.status
        rows.append({
            "task": t.name, "job": t.job, "index": t.index, "host": t.host, "address": t.address,
            "state": st.state,
            "serving": info.serving if info else False,
            "pid": info.pid if info else None,  # the supervisor's
            "server_pid": info.server_pid if info else None,
            "uptime": info.uptime if info else None,  # of the server, since its last (re)start
            "restarts": info.restarts if info else 0,
            "last_exit": info.last_exit if info else None,
            "error": st.reason,
            "recovered": (recovered or {}).get(t.name),
        })
    return rows


def show_status(record: Record, rows: list[dict[str, Any]], as_json: bool,
                report: AllocationReport | None = None, training: dict[str, Any] | None = None) -> None:
    """The status table (or JSON); `report`: the hosts' allocation where a scheduler lends them
    (dtf.providers): its line above the table; while it no longer runs the JSON says why, and the
    table is not shown (the caller says the line as its error). `training`: what a `dtf train` on
    the cluster from this machine does now (dtf.top.training), its line below the table."""
    plan = record.plan
    if as_json:
        console().print_json(json.dumps({"schema": STATUS_SCHEMA, "cluster": plan.cluster,
                                         "network": record.network, "firewall": plan.firewall, "tasks": rows,
                                         "training": training,
                                         **({report.key: report.doc} if report is not None else {})}))
        return
    if report is not None and report.ended is not None:
        return
    if report is not None:
        say(report.line)
    from rich.table import Table

    # Columns without borders, and only the last exit wraps: the table reads whole at 80 columns.
    tab = Table(title=f"cluster {plan.cluster} (network: {record.network}, firewall: {plan.firewall})",
                title_justify="left", box=None, padding=(0, 2, 0, 0), header_style="bold")
    for col in ("task", "host", "address", "pid", "state", "uptime", "restarts"):
        tab.add_column(col, no_wrap=True)
    tab.add_column("last exit", overflow="fold", min_width=9)
    for r in rows:
        color = {"alive": "green", "restarting": "yellow"}.get(r["state"], "red")
        uptime = f"{r['uptime']:.0f}s" if r["uptime"] is not None else "-"
        tab.add_row(r["task"], r["host"], r["address"], str(r["server_pid"] or "-"),
                    f"[{color}]{r['state']}[/]", uptime, str(r["restarts"]), r["last_exit"] or "-")
    console().print(tab)
    for r in rows:
        if r.get("recovered"):
            say(f"{r['task']}: {r['recovered']}")
    if training is not None:
        from dtf import top

        say(top.training_lines(training)[0])
    for r in rows:
        if r["error"] and r["state"] != "unknown":
            say(f"{r['task']} ({r['host']}): {r['error']}", stderr=True)
    for host, error in dict.fromkeys((r["host"], r["error"]) for r in rows if r["state"] == "unknown"):
        say(f"{host}: {error}", stderr=True)


def show_shares(shares: Shares, seconds: float) -> None:
    """After `dtf train`: what each worker did (dtf.program.figures.Shares), on stderr with dtf's
    other lines about the run; nothing where the program ran no closure (or published no figures:
    DTF_FIGURES=off). Steps only where dtf knows them, and the share of each worker in them (else
    in the closures)."""
    if not shares.closures:
        return
    known = shares.unknown < shares.closures
    total = shares.steps if known else shares.closures
    over = f" over {shares.attempts} attempts" if shares.attempts > 1 else ""
    say(f"dtf: what each worker did in {seconds:.1f}s{over}, as the coordinator counted it (time: how long "
        f"its closures took, round trips included):", stderr=True)
    rows = [[f"worker:{index}", w.host, str(w.closures), *([str(w.steps)] if known else []),
             f"{100 * (w.steps if known else w.closures) / max(1, total):.0f}%", _duration(w.busy)]
            for index, w in sorted(shares.workers.items())]
    say(columns(["task", "host", "closures", *(["steps"] if known else []), "share", "time"], rows), stderr=True)
    why = "evaluate()'s shards, or functions the program schedules without dtf.packing()"
    if not known:
        say(f"no steps: dtf does not know how many each closure ran ({why})", stderr=True)
    elif shares.unknown:
        say(f"steps leave out {shares.unknown} closure(s) whose steps dtf does not know ({why})", stderr=True)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"
