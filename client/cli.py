"""The `dtf` command. This module only wires commands; the logic lives in inventory, plan,
cluster, state and train. Expected failures (DtfError) become one red line and an exit code here;
anything else is a bug: one line on screen, the traceback in $DTF_HOME/debug.log.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from dtf import state
from dtf.errors import ClusterDown, DtfError, ExitCode, HostFailure, NoCluster

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


def _load_plan(inventory_path: Path):
    from dtf import inventory
    from dtf.plan import make_plan
    from dtf.transport import resolver

    inv = inventory.load(inventory_path)
    return make_plan(inv, resolve=resolver(inv.ssh_config), local_python=sys.executable)


def _recorded(cluster: Optional[str]) -> tuple[str, dict]:
    with state.locked():
        name = state.resolve_name(cluster)
        return name, state.load(name)


@app.command()
@guarded
def up(
    inventory: Path = typer.Argument(..., help="The inventory YAML file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Start one TensorFlow server per ps and worker task of INVENTORY, and wait until all serve."""
    from dtf import ui
    from dtf.cluster import ClusterOps
    from dtf.plan import Plan

    plan = _load_plan(inventory)
    if dry_run:
        ui.show_plan(plan)
        return
    digest = hashlib.sha256(inventory.read_bytes()).hexdigest()
    with state.locked():
        if plan.cluster in state.names():
            record = state.load(plan.cluster)
            if record.get("inventory_digest") != digest:
                raise DtfError(f"cluster {plan.cluster!r} is already up from {record['inventory']}, "
                               f"which differs from {inventory}: run `dtf down -c {plan.cluster}` first")
            recorded = Plan.from_dict(record["plan"])
            rows = ui.status_rows(recorded, ClusterOps(recorded, connect_timeout=connect_timeout).status())
            dead = [r["task"] for r in rows if not r["serving"]]
            if dead:
                raise ClusterDown(f"cluster {plan.cluster!r} is up but {', '.join(dead)} not serving: "
                                  f"run `dtf down -c {plan.cluster}`, then `dtf up` again")
            ui.out.print(f"cluster {plan.cluster} is already up: {len(rows)} tasks serving; "
                         f"nothing changed", markup=False)
            return

        t0 = time.monotonic()
        with ui.host_progress([h.name for h in plan.hosts], f"dtf up {plan.cluster}") as progress:
            ops = ClusterOps(plan, progress, connect_timeout=connect_timeout)
            outcomes = ops.up()
            failures = {h: o.reason for h, o in outcomes.items() if not o.ok}
            if failures or ops.cancel.is_set():
                touched = tuple(hp for hp in plan.hosts if hp.name in ops.touched)
                if touched:
                    # A fresh ClusterOps: `ops` may be cancelled (Ctrl-C), and a cancelled one
                    # refuses every step, the rollback's too.
                    rollback = ClusterOps(plan, progress, connect_timeout=connect_timeout)
                    for host, o in rollback.down(hosts=touched).items():
                        if not o.ok:
                            failures[host] = f"{failures.get(host, 'started')}; rollback failed: {o.reason}"
        if ops.cancel.is_set():
            raise KeyboardInterrupt
        if failures:
            raise HostFailure("dtf up", failures)
        client = next((o.data["client_address"] for o in outcomes.values()
                       if o.data.get("client_address")), None)
        state.save(plan.cluster, {
            "cluster": plan.cluster,
            "inventory": str(inventory.resolve()),
            "inventory_digest": digest,
            "created": time.time(),
            "chief_host": client or "127.0.0.1",  # the laptop as the hosts see it
            "pids": {name: pid for o in outcomes.values() for name, pid in o.data["pids"].items()},
            "plan": plan.to_dict(),
        })
    ui.show_up(plan, outcomes, time.monotonic() - t0)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
@guarded
def train(
    program: Path = typer.Argument(..., help="The Python program to run as the coordinator."),
    args: list[str] = typer.Argument(None, help="Arguments passed to the program."),
    cluster: Optional[str] = ClusterOpt,
    output: Optional[Path] = typer.Option(None, help="Sets $DTF_OUTPUT_DIR (dtf.output_dir())."),
) -> None:
    """Run PROGRAM here as the chief of the cluster; its exit code is dtf's."""
    from dtf.plan import Plan
    from dtf.train import run_program

    _, record = _recorded(cluster)
    code = run_program(Plan.from_dict(record["plan"]), record, str(program), list(args or []),
                       str(output) if output else None)
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
    from dtf.cluster import ClusterOps
    from dtf.plan import Plan

    with state.locked():
        name = state.resolve_name(cluster)
        record = state.load(name)
        plan = Plan.from_dict(record["plan"])
        t0 = time.monotonic()
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
    stopped = sum(1 for o in outcomes.values() for s in o.data["stopped"].values() if s["was_running"])
    ui.out.print(f"cluster {name} is down: {stopped} server(s) stopped on {len(outcomes)} host(s) "
                 f"in {time.monotonic() - t0:.1f}s", markup=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
