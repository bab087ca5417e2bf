"""The `dtf` command. This module only wires commands; the logic lives in inventory, plan,
cluster, state and train. Expected failures (DtfError) become one red line and an exit code here;
anything else is a bug: one line on screen, the traceback in $DTF_HOME/debug.log.
"""

from __future__ import annotations

import functools
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from dtf import state
from dtf.errors import ClusterChanged, DtfError, ExitCode, HostFailure, NoCluster, UsageError

app = typer.Typer(
    help="Train TensorFlow models on a cluster of SSH hosts, driven from your laptop.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # never print locals: keys and passwords live there
)

ClusterOpt = typer.Option(None, "--cluster", "-c", help="Cluster name (default: the only one up).")
ConnectTimeoutOpt = typer.Option(10.0, "--connect-timeout", help="Seconds to connect to each host.")


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map DtfError to one line and its exit code; log unexpected tracebacks, show one line."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from dtf import ui

        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except DtfError as e:
            ui.error(e.lines())
            raise typer.Exit(int(e.exit_code))
        except KeyboardInterrupt:
            ui.error(["interrupted"])
            raise typer.Exit(int(ExitCode.INTERRUPTED))
        except Exception as e:
            log = state.home() / "debug.log"
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "a") as f:
                    f.write(f"--- {time.ctime()} dtf {' '.join(sys.argv[1:])}\n{traceback.format_exc()}")
            except OSError:
                pass
            ui.error([f"internal error: {type(e).__name__}: {e} (traceback in {log})"])
            raise typer.Exit(int(ExitCode.FAILURE))

    return wrapper


def _load_plan(inventory_path: Path, ttl: float | None = None):
    from dtf import inventory
    from dtf.plan import DEFAULT_TTL, make_plan
    from dtf.transport import resolver

    inv = inventory.load(inventory_path)
    if inv.ssh_config:
        _check_ssh_config(inventory_path, inv.ssh_config)
    return make_plan(inv, resolve=resolver(inv.ssh_config), local_python=sys.executable,
                     ttl=DEFAULT_TTL if ttl is None else ttl)


def _check_ssh_config(inventory_path: Path, ssh_config: str) -> None:
    """The inventory's ssh_config must be a file paramiko can read: say so at the inventory's
    `ssh_config:` line, not with a traceback later."""
    import os

    import paramiko

    from dtf.errors import InventoryError, Problem

    text = inventory_path.read_text(errors="replace")
    line = next((i for i, s in enumerate(text.splitlines(), 1) if s.startswith("ssh_config")), 1)
    path = os.path.expanduser(ssh_config)
    try:
        paramiko.SSHConfig.from_path(path)
    except OSError as e:
        reason = e.strerror or str(e)
    except Exception as e:  # paramiko's own parse errors
        reason = f"cannot parse it: {e}"
    else:
        return
    raise InventoryError([Problem(str(inventory_path), line, 1, "ssh_config", f"{ssh_config}: {reason}")])


def _recorded(cluster: Optional[str]) -> tuple[str, dict]:
    with state.locked():
        name = state.resolve_name(cluster)
        return name, state.load(name)


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, option: str) -> float:
    """'90', '90s', '30m', '2h', '1d' in seconds; '0' or 'never' is 0 (no limit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip().lower())
    if text.strip().lower() == "never":
        return 0.0
    if not m:
        raise UsageError(f"{option}: expected a duration like 90s, 30m, 2h or 0 (never), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _by_host(rows: list[dict]) -> dict[str, set[str]]:
    tasks: dict[str, set[str]] = {}
    for r in rows:
        tasks.setdefault(r["host"], set()).add(r["task"])
    return tasks


@app.command()
@guarded
def up(
    inventory: Path = typer.Argument(..., help="The inventory YAML file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    ttl: Optional[str] = typer.Option(
        None, "--ttl", show_default=False,
        help="Idle timeout: when no dtf command has used the cluster for this long (90s, 30m, 2h), "
             "its tasks stop themselves and remove their files. 0 or never: no timeout. "
             "Default: 1h."),
    replace: bool = typer.Option(False, "--replace",
                                 help="If the cluster is up from a different inventory: stop it "
                                      "and start this one."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Start one TensorFlow server per ps and worker task of INVENTORY, and wait until all serve.

    On a cluster that is already up: restart only the tasks that are not serving.
    """
    from dtf import ui
    from dtf.plan import Plan, differences

    ttl_seconds = None if ttl is None else parse_duration(ttl, "--ttl")
    plan = _load_plan(inventory, ttl_seconds)
    if dry_run:
        ui.show_plan(plan)
        return
    with state.locked():
        if plan.cluster in state.names():
            record = state.load(plan.cluster)
            recorded = Plan.from_dict(record["plan"])
            changes = differences(recorded, plan)
            if changes and not replace:
                raise ClusterChanged(plan.cluster, record["inventory"], str(inventory), changes)
            if changes:
                _down(plan.cluster, record, recorded, keep_logs=False, grace=10.0,
                      connect_timeout=connect_timeout)
            else:
                _repair(inventory, record, recorded, ttl_seconds, connect_timeout)
                return
        t0 = time.monotonic()
        outcomes = _start(plan, None, connect_timeout)
        client = next((o.data["client_address"] for o in outcomes.values()
                       if o.data.get("client_address")), None)
        state.save(plan.cluster, {
            "cluster": plan.cluster,
            "inventory": str(inventory.resolve()),
            "created": time.time(),
            "chief_host": client or "127.0.0.1",  # the laptop as the hosts see it
            "pids": {name: pid for o in outcomes.values() for name, pid in o.data["pids"].items()},
            "plan": plan.to_dict(),
        })
    ui.show_up(plan, outcomes, time.monotonic() - t0)


def _start(plan, only: dict[str, set[str]] | None, connect_timeout: float) -> dict:
    """Start the plan's tasks (or only some, per host); on any failure or Ctrl-C, stop what was
    started and raise."""
    from dtf import ui
    from dtf.cluster import ClusterOps

    hosts = [h.name for h in plan.hosts if only is None or only.get(h.name)]
    with ui.host_progress(hosts, f"dtf up {plan.cluster}") as progress:
        ops = ClusterOps(plan, progress, connect_timeout=connect_timeout)
        outcomes = ops.up(only)
        failures = {h: o.reason for h, o in outcomes.items() if not o.ok}
        if failures or ops.cancel.is_set():
            # A fresh ClusterOps: `ops` may be cancelled (Ctrl-C), and a cancelled one refuses
            # every step, the rollback's too.
            rollback = ClusterOps(plan, progress, connect_timeout=connect_timeout)
            if only is None:
                started = tuple(hp for hp in plan.hosts if hp.name in ops.started)
                uploaded = tuple(hp for hp in plan.hosts if hp.name in ops.touched - ops.started)
                undone = {**rollback.down(hosts=started), **rollback.remove_launcher(uploaded)}
            else:  # leave the tasks that were serving alone
                undone = rollback.stop_tasks({h: only[h] for h in only if h in ops.started})
            for host, o in undone.items():
                if not o.ok:
                    failures[host] = f"{failures.get(host, 'started')}; rollback failed: {o.reason}"
    if ops.cancel.is_set():
        raise KeyboardInterrupt
    if failures:
        raise HostFailure("dtf up", failures)
    return outcomes


def _repair(inventory: Path, record: dict, plan, ttl: float | None, connect_timeout: float) -> None:
    """`dtf up` on a cluster that is up from the same inventory: restart only the tasks that are
    not serving (their supervisor gave up, or was killed, or the host rebooted)."""
    import dataclasses

    from dtf import ui
    from dtf.cluster import ClusterOps

    new_ttl = ttl is not None and any(hp.ttl != ttl for hp in plan.hosts)
    if new_ttl:
        plan = dataclasses.replace(plan, hosts=tuple(dataclasses.replace(hp, ttl=ttl) for hp in plan.hosts))
    ops = ClusterOps(plan, connect_timeout=connect_timeout)
    if new_ttl:
        for o in ops.renew(ttl).values():
            if not o.ok:
                raise HostFailure("dtf up (renewing the lease)", {o.host: o.reason})
        record["plan"] = plan.to_dict()
        state.save(plan.cluster, record)
    rows = ui.status_rows(plan, ops.status())
    unknown = {r["host"]: r["error"] for r in rows if r["state"] == "unknown"}
    if unknown:
        raise HostFailure("dtf up (checking the running cluster)", unknown)
    dead = [r for r in rows if r["state"] != "alive"]
    if not dead:
        lease = f"; idle timeout now {ttl:g}s" if ttl is not None else ""
        ui.out.print(f"cluster {plan.cluster} is already up: {len(rows)} tasks serving{lease}",
                     markup=False)
        return
    t0 = time.monotonic()
    only = _by_host(dead)
    ops.stop_tasks(only)  # supervisors that gave up
    outcomes = _start(plan, only, connect_timeout)
    for o in outcomes.values():
        record["pids"].update(o.data["pids"])
    record["inventory"] = str(inventory.resolve())
    state.save(plan.cluster, record)
    restarted = ", ".join(f"{r['task']} (was {r['state']})" for r in dead)
    ui.out.print(f"cluster {plan.cluster}: restarted {restarted} in {time.monotonic() - t0:.1f}s; "
                 f"{len(rows) - len(dead)} task(s) kept running", markup=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
@guarded
def train(
    program: Path = typer.Argument(..., help="The Python program to run as the coordinator."),
    args: list[str] = typer.Argument(None, help="Arguments passed to the program."),
    cluster: Optional[str] = ClusterOpt,
    output: Optional[Path] = typer.Option(None, help="Sets $DTF_OUTPUT_DIR (dtf.output_dir())."),
    attempts: int = typer.Option(3, "--attempts", min=1,
                                 help="Runs of the program in all: after a lost ps, dtf waits for "
                                      "it to serve again and runs the program again (it resumes "
                                      "from its last checkpoint)."),
    ps_wait: float = typer.Option(120.0, "--ps-wait", help="Seconds to wait for a lost ps to serve again."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Run PROGRAM here as the chief of the cluster; its exit code is dtf's."""
    from dtf.plan import Plan
    from dtf.train import run_program

    _, record = _recorded(cluster)
    code = run_program(Plan.from_dict(record["plan"]), record, str(program), list(args or []),
                       str(output) if output else None, attempts=attempts, ps_wait=ps_wait,
                       connect_timeout=connect_timeout)
    raise typer.Exit(code)


@app.command()
@guarded
def status(
    cluster: Optional[str] = ClusterOpt,
    json_out: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Show every task: host, role, index, address, pid, alive or dead, uptime (checked live)."""
    from dtf import ui
    from dtf.cluster import ClusterOps
    from dtf.plan import Plan

    _, record = _recorded(cluster)
    plan = Plan.from_dict(record["plan"])
    rows = ui.status_rows(plan, ClusterOps(plan, connect_timeout=connect_timeout).status())
    ui.show_status(plan, rows, json_out)
    if any(r["state"] != "alive" for r in rows):
        raise typer.Exit(int(ExitCode.CLUSTER_DOWN))


@app.command()
@guarded
def logs(
    task: str = typer.Argument(..., help="The task, e.g. worker:1 or ps:0."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(100, "--lines", "-n", help="How many last lines to print."),
    cluster: Optional[str] = ClusterOpt,
) -> None:
    """Print a task's log from its host."""
    from dtf.plan import Plan
    from dtf.transport import HostError, transport_for

    name, record = _recorded(cluster)
    plan = Plan.from_dict(record["plan"])
    t = plan.task(task)
    if t is None:
        raise NoCluster(f"cluster {name!r} has no task {task!r} "
                        f"(tasks: {', '.join(x.name for x in plan.tasks())})")
    hp = plan.host_of(t)
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), t.log]
    try:
        with transport_for(hp.spec, plan.ssh_config) as conn:
            conn.run(hp.renew_argv(), timeout=15)  # reading a log is using the cluster
            code = conn.stream(argv)
    except HostError as e:
        raise HostFailure("dtf logs", {hp.name: str(e)})
    raise typer.Exit(code)


@app.command()
@guarded
def down(
    cluster: Optional[str] = ClusterOpt,
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Leave the task logs on the hosts."),
    grace: float = typer.Option(10.0, help="Seconds between TERM and KILL."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Stop every task, check none remains, remove dtf's files from the hosts, forget the cluster."""
    from dtf import ui
    from dtf.plan import Plan

    with state.locked():
        name = state.resolve_name(cluster)
        record = state.load(name)
        t0 = time.monotonic()
        outcomes = _down(name, record, Plan.from_dict(record["plan"]), keep_logs, grace, connect_timeout)
    stopped = sum(1 for o in outcomes.values() for s in o.data["stopped"].values() if s["was_running"])
    ui.out.print(f"cluster {name} is down: {stopped} server(s) stopped on {len(outcomes)} host(s) "
                 f"in {time.monotonic() - t0:.1f}s", markup=False)


def _down(name: str, record: dict, plan, keep_logs: bool, grace: float, connect_timeout: float) -> dict:
    """Stop every task and remove the files; forget the cluster, or keep the hosts that failed."""
    from dtf import ui
    from dtf.cluster import ClusterOps

    with ui.host_progress([h.name for h in plan.hosts], f"dtf down {name}") as progress:
        ops = ClusterOps(plan, progress, connect_timeout=connect_timeout)
        outcomes = ops.down(keep_logs=keep_logs, grace=grace)
    failures = {h: o.reason for h, o in outcomes.items() if not o.ok}
    if failures:
        # Keep only the hosts that could not be cleaned, so a later `dtf down` retries them.
        record["plan"]["hosts"] = [h for h in record["plan"]["hosts"] if h["spec"]["host"] in failures]
        state.save(name, record)
        raise HostFailure("dtf down", {h: f"{r} (kept in the record: run `dtf down` again)"
                                       for h, r in failures.items()})
    state.remove(name)
    return outcomes


def main() -> None:
    app()


if __name__ == "__main__":
    main()
