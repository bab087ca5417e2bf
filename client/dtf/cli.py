"""The `dtf` command (`main`). This module only parses, calls and prints: the lifecycle of a
cluster (start with rollback, a Slurm allocation's included, repair, teardown, the record) lives
in `lifecycle`, status and logs in `hostops.status`, running a program in `train`, what things
look like in `ui`. Expected failures (DtfError) become one red line and an exit code here;
anything else is a bug: one line on screen, the traceback in $DTF_HOME/debug.log.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from dtf.cluster import state
from dtf.cluster.durations import parse_duration
from dtf.errors import DtfError, ExitCode, NoCluster, UsageError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf_server.protocol import Defaults

app = typer.Typer(
    help="Train TensorFlow models on a cluster of SSH hosts, driven from your laptop.",
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # never print locals: keys and passwords live there
)

ClusterOpt = typer.Option(None, "--cluster", "-c", help="Cluster name (default: the only one up).")
ConnectTimeoutOpt = typer.Option(CONNECT_TIMEOUT, "--connect-timeout", help="Seconds to connect to each host.")


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
        except BrokenPipeError:
            # What reads dtf's output went away (`dtf status | head -3`): nothing to say, as any
            # tool in a pipe; what is still buffered for it goes nowhere (Python's documented way).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(int(ExitCode.FAILURE))
        except Exception as e:
            log = state.home() / "debug.log"
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "a") as f:
                    f.write(f"--- {time.ctime()} dtf {' '.join(sys.argv[1:])}\n{traceback.format_exc()}")
            except OSError:
                pass
            ui.error([f"internal error: {type(e).__name__}: {e} (at {where(e)}; traceback in {log})"])
            raise typer.Exit(int(ExitCode.FAILURE))

    return wrapper


_PACKAGES = ("dtf", "dtf_server")  # dtf's own code, in a traceback's file names


def where(e: BaseException) -> str:
    """Where an unexpected exception was raised, for its one line: the innermost frame (a library's
    too: `paramiko/config.py:312`), and the innermost of dtf's own when that is another one."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"

    def short(f: traceback.FrameSummary) -> str:
        parts = Path(f.filename).parts
        at = max((i for i, p in enumerate(parts) if p in _PACKAGES), default=len(parts) - 2)
        return f"{'/'.join(parts[max(at, 0):])}:{f.lineno}"

    ours = [f for f in frames if any(p in _PACKAGES for p in Path(f.filename).parts)]
    last = short(frames[-1])
    return last if not ours or ours[-1] is frames[-1] else f"{last}, from {short(ours[-1])}"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"dtf {version('dtf')}")
        except PackageNotFoundError:
            typer.echo("dtf (not installed: running from a source tree)")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print dtf's version and exit."),
) -> None:
    """Train TensorFlow models on a cluster of SSH hosts, driven from your laptop."""


@app.command()
@guarded
def up(
    inventory: Path = typer.Argument(..., metavar="INVENTORY", help="The inventory YAML file."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; touch nothing."),
    ttl: str | None = typer.Option(
        None, "--ttl", show_default=False,
        help="Idle timeout: when no dtf command has used the cluster for this long (90s, 30m, 2h), "
             "its tasks stop themselves and remove their files. 0 or never: no timeout. "
             "Default: 1h."),
    replace: bool = typer.Option(False, "--replace",
                                 help="If the cluster is up from a different inventory: stop it "
                                      "and start this one."),
    network: str | None = typer.Option(
        None, "--network", show_default=False,
        help="How this machine reaches the TF ports: direct, ssh (through SSH to each host: for "
             "laptops behind NAT and hosts that open only port 22), or auto (test, then pick). "
             "Default: the inventory's network, else auto."),
    connect_timeout: float = ConnectTimeoutOpt,
    allocation_wait: float = typer.Option(600.0, "--slurm-wait",
                                     help="Slurm: seconds the allocation may pend before dtf cancels it."),
) -> None:
    """Start the cluster INVENTORY describes.

    Starts one TensorFlow server per ps and worker task and waits until every one serves. On a
    cluster that is already up, it restarts only the tasks that are not serving.
    """
    from dtf import ui
    from dtf.cluster.inventory import NETWORKS
    from dtf.cluster.inventory import load as load_inventory

    if network is not None and network not in NETWORKS:
        raise UsageError(f"--network: expected one of {', '.join(NETWORKS)}, got {network!r}")
    ttl_seconds = None if ttl is None else parse_duration(ttl, "--ttl")
    inv = load_inventory(inventory)
    from dtf.hostops import lifecycle

    if dry_run and ui.show_request(inv):  # hosts a scheduler lends: what `up` asks for, no plan yet
        return
    server = os.environ.get(lifecycle.SERVER_ENV) or "tensorflow"
    if replace and not dry_run:  # the cluster it replaces: its detached run's outputs first, as `down`
        settle_detached(inv.cluster, connect_timeout, stop_run=False, grace=Defaults.STOP_GRACE)
    with lifecycle.allocated(inv, wait=allocation_wait, say=ui.say, connect_timeout=connect_timeout,
                             replace=replace, view=ui.host_progress, ttl=ttl_seconds) as allocation:
        plan = lifecycle.load_plan(inv, ttl_seconds, server, network=network, allocation=allocation)
        if dry_run:
            ui.show_plan(plan)
            return
        from dtf.files import sync

        with sync.packed([(item.name, item.path) for item in plan.sync]) as packs:
            ui.show_packs(packs)
            result = lifecycle.up(plan, ttl=ttl_seconds, replace=replace, connect_timeout=connect_timeout,
                                  view=ui.host_progress, packs=packs)
    ui.show_up_result(result)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})
@guarded
def train(
    program: Path = typer.Argument(..., metavar="PROGRAM", help="The Python program to run as the coordinator."),
    args: list[str] = typer.Argument(None, metavar="[ARGS]...", help="Arguments passed to the program."),
    cluster: str | None = ClusterOpt,
    output: Path | None = typer.Option(None, help="Sets $DTF_OUTPUT_DIR (dtf.output_dir())."),
    attempts: int = typer.Option(3, "--attempts", min=1,
                                 help="Runs of the program in all: after a lost ps, dtf waits for "
                                      "it to serve again (on Slurm, replaces a job that ended with a "
                                      "new allocation) and runs the program again (it resumes from "
                                      "its last checkpoint)."),
    ps_wait: float = typer.Option(120.0, "--ps-wait", help="Seconds to wait for a lost ps to serve again."),
    network_wait: float = typer.Option(600.0, "--network-wait",
                                       help="Seconds to wait for the cluster to answer this machine again once "
                                            "none of its tasks does (a dropped network, a laptop that slept); "
                                            "the program then runs again from its last checkpoint."),
    allocation_wait: float = typer.Option(600.0, "--slurm-wait",
                                     help="Slurm: seconds the new allocation that replaces an ended job "
                                          "may pend before dtf cancels it and ends the run."),
    collective: bool = typer.Option(False, "--collective",
                                    help="Run PROGRAM on the hosts, one copy per worker task, under "
                                         "MultiWorkerMirroredStrategy."),
    join_timeout: float = typer.Option(300.0, "--join-timeout",
                                       help="--collective: seconds every copy gets to join the others."),
    connect_timeout: float = ConnectTimeoutOpt,
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Show TensorFlow's own INFO and WARNING lines (hidden by default)."),
    wrap: bool = typer.Option(False, "--wrap",
                              help="PROGRAM is a single-machine Keras script with no strategy code: dtf "
                                   "makes the strategy, builds the model in its scope, supplies what "
                                   "the strategy needs, and says what it changed."),
    packing: bool = typer.Option(True, "--packing/--no-packing",
                                 help="Pack steps into each closure where the program sets no "
                                      "steps_per_execution (measured at the start of fit)."),
    detach: bool = typer.Option(False, "--detach",
                                help="Run PROGRAM as the coordinator on a host of the cluster (the "
                                     "inventory's `coordinator:`, else the first ps host) and return once "
                                     "it started: this machine may then sleep or go offline. `dtf attach` "
                                     "follows it and brings its outputs here."),
) -> None:
    """Run PROGRAM as the coordinator of the cluster.

    PROGRAM runs here, as the chief of the cluster (with --collective: on the hosts, one copy per
    worker; with --detach: on a host of the cluster). dtf exits with the program's exit code
    (with --detach: 0 once it started).
    """
    from dtf import ui
    from dtf.hostops import lifecycle
    from dtf.program.hooks import packing as packing_hook
    from dtf.program.hooks import wrap as wrap_hook
    from dtf.program.train import run_program

    hook_env = {packing_hook.ENV: "auto" if packing else "off"}
    if wrap:
        hook_env[wrap_hook.ENV] = "1"

    if not program.is_file():
        raise UsageError(f"program not found: {program}")
    if program.suffix == ".ipynb":  # run in a Jupyter kernel (dtf.notebook.execute)
        from dtf.notebook.execute import check_notebook

        check_notebook(program, list(args or []), collective=collective, wrap=wrap)
        if verbose:
            hook_env["DTF_VERBOSE"] = "1"
    if detach:
        from dtf.detached.start import detach as start_detached

        record = lifecycle.recorded(cluster)
        d = start_detached(record, program, list(args or []), output, attempts=attempts, ps_wait=ps_wait,
                           network_wait=network_wait, connect_timeout=connect_timeout, verbose=verbose,
                           hook_env=hook_env, collective=collective,
                           say=lambda line: ui.say(f"dtf: {line}", stderr=True))
        ui.say(f"dtf: {d.program} runs detached on {d.host} (cluster {record.cluster}): `dtf attach` follows it "
               f"and brings its outputs here; this machine may now sleep, go offline or shut down", stderr=True)
        return
    recorded = lifecycle.recorded(cluster)
    if recorded.detached is not None:  # one coordinator per cluster
        from dtf.detached.remote import refuse_if_running
        from dtf.hostops.parallel import HostOps

        refuse_if_running(recorded, HostOps(recorded.plan, connect_timeout=connect_timeout))
    if collective:
        from dtf.collective.run import run_collective
        from dtf.program.train import taken_down

        raise typer.Exit(run_collective(recorded, str(program), list(args or []), str(output) if output else None,
                                        attempts=attempts, join_timeout=join_timeout,
                                        connect_timeout=connect_timeout, taken_down=lambda: taken_down(recorded),
                                        verbose=verbose))
    started = time.monotonic()
    code = run_program(recorded, str(program), list(args or []),
                       str(output) if output else None, attempts=attempts, ps_wait=ps_wait,
                       connect_timeout=connect_timeout, verbose=verbose, hook_env=hook_env,
                       allocation_wait=allocation_wait, network_wait=network_wait,
                       report=lambda shares: ui.show_shares(shares, time.monotonic() - started))
    raise typer.Exit(code)


@app.command(name="sync")
@guarded
def sync_(
    path: Path = typer.Argument(..., metavar="PATH",
                                help="A local file or directory (a directory's .gitignore files apply)."),
    as_name: str | None = typer.Option(None, "--as", help="The name dtf.synced(NAME) finds it by "
                                                          "(default: the path's last part)."),
    cluster: str | None = ClusterOpt,
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Send PATH to every host of the cluster.

    A host that already has the same content is skipped.
    """
    from dtf import ui
    from dtf.files import sync
    from dtf.hostops import lifecycle

    name = as_name or sync.default_name(str(path))
    flaw = sync.name_flaw(name)
    if flaw:
        raise UsageError(f"--as: {flaw}" if as_name else f"cannot name {str(path)!r} after its path: {flaw}; "
                                                          f"pass --as NAME")
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    cluster = lifecycle.recorded(cluster).cluster  # no cluster: say so before packing anything
    with sync.packed([(name, str(path))]) as packs:
        ui.show_packs(packs)
        _, reports = lifecycle.sync_to(cluster, packs, connect_timeout=connect_timeout, view=ui.host_progress)
    for report in reports:
        ui.say(report.line())


@app.command()
@guarded
def status(
    cluster: str | None = ClusterOpt,
    json_out: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Show every task and whether it serves.

    Each task's host, role, index, address, pid, state and uptime, checked live.
    """
    from dtf import top as view
    from dtf import ui
    from dtf.hostops.status import cluster_status
    from dtf.program import figures

    found = cluster_status(cluster, connect_timeout=connect_timeout)
    rows = ui.status_rows(found.states, found.record.recovered)
    training = view.training(figures.live_dir(state.home(), found.record.cluster))
    if found.record.detached is not None:  # `dtf train --detach`: asked of the coordinator's host
        from dtf.hostops.parallel import HostOps

        training = view.detached_training(found.record, HostOps(found.record.plan, connect_timeout=connect_timeout))
    ui.show_status(found.record, rows, json_out, found.report, training)
    if found.ended is not None:
        raise found.ended_error()
    if any(r["state"] != "alive" for r in rows):
        raise typer.Exit(int(ExitCode.CLUSTER_DOWN))


@app.command()
@guarded
def top(
    cluster: str | None = ClusterOpt,
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit (for scripts)."),
    json_out: bool = typer.Option(False, "--json", help="Print one snapshot as JSON and exit."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between two refreshes (and samples)."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Watch the cluster and its training live.

    Every task's state, restarts, uptime, CPU, memory and network, and the training that
    `dtf train` runs on the cluster. Press q or Ctrl-C to quit. Each host pushes a sample every
    interval over one connection kept for the view's life.
    """
    from dtf import top as view
    from dtf import ui
    from dtf.hostops import lifecycle
    from dtf.hostops.parallel import HostOps
    from dtf.hostops.watch import Watch
    from dtf.program import figures

    if not 0.1 <= interval <= 3600:
        raise UsageError(f"--interval: expected seconds between 0.1 and 3600, got {interval:g}")
    if not (once or json_out) and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("dtf top: not a terminal: pass --once or --json for one snapshot")
    from rich.console import Console

    record = lifecycle.recorded(cluster)
    plan = record.plan
    live_dir = figures.live_dir(state.home(), plan.cluster)

    def trained() -> dict[str, Any] | None:  # the training: here, or a detached run on its host
        if record.detached is None:
            return view.training(live_dir)
        return view.detached_training(record, HostOps(plan, connect_timeout=connect_timeout))

    # Not ui.console(): a soft-wrapping console squeezes the table to 80 columns.
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 200)
    with Watch(HostOps(plan, connect_timeout=connect_timeout), interval) as watch:
        if not (once or json_out):
            def recorded() -> state.Record | None:  # tasks moved to a spare: the view follows the record
                try:
                    return lifecycle.recorded(plan.cluster)
                except DtfError:
                    return None

            view.live(record, watch, trained, interval, console, recorded=recorded,
                      watch_for=lambda p: Watch(HostOps(p, connect_timeout=connect_timeout), interval))
            return
        # Two samples per host: CPU% and the byte rates are differences between two.
        watch.wait_samples(2, timeout=connect_timeout + 2 * interval + 15)
        doc = view.snapshot(plan, watch.feeds(), trained(), record.recovered)
    if json_out:
        import json

        ui.console().print_json(json.dumps(doc))
    else:
        console.print(view.view(doc, height=console.size.height if console.is_terminal else 10**6))
    if any(r["state"] != "alive" for r in doc["tasks"]):
        raise typer.Exit(int(ExitCode.CLUSTER_DOWN))


@app.command()
@guarded
def attach(
    cluster: str | None = ClusterOpt,
    lines: int | None = typer.Option(None, "--lines", "-n", min=0,
                                     help="Start at the output's last N lines (default: where the last "
                                          "attach stopped; the first time, the run's start)."),
    wait: float = typer.Option(600.0, "--wait",
                               help="Seconds to keep trying when the run's host does not answer "
                                    "(this machine's network dropped, or it slept)."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Follow a detached run (`dtf train --detach`), then bring its outputs here.

    Prints the run's output from where the last attach stopped (each line once), follows it until
    the program ends, brings what it wrote back where it was started, and exits with its exit code.
    Ctrl-C detaches and leaves the run going.
    """
    from dtf import ui
    from dtf.detached.attach import attach as follow_run
    from dtf.hostops import lifecycle

    raise typer.Exit(follow_run(lifecycle.recorded(cluster), lines=lines, wait=wait, connect_timeout=connect_timeout,
                                say=lambda line: ui.say(f"dtf: {line}", stderr=True)))


@app.command()
@guarded
def logs(
    task: str = typer.Argument(..., metavar="TASK", help="The task, e.g. worker:1 or ps:0."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(100, "--lines", "-n", min=0, help="How many last lines to print."),
    everything: bool = typer.Option(False, "--all", "-a",
                                    help="Show TensorFlow's own lines too (its C++ runtime's log, "
                                         "hidden by default)."),
    cluster: str | None = ClusterOpt,
) -> None:
    """Print a task's log from its host: dtf's lines and the server's (or the program's), without
    TensorFlow's own unless --all."""
    from dtf.hostops.status import tail_log

    raise typer.Exit(tail_log(cluster, task, lines=lines, follow=follow, everything=everything))


@app.command()
@guarded
def down(
    cluster: str | None = ClusterOpt,
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Leave the task logs on the hosts."),
    grace: float = typer.Option(Defaults.STOP_GRACE, help="Seconds between TERM and KILL."),
    purge: bool = typer.Option(False, "--purge",
                               help="Also remove each host's cache (WORKDIR/.cache: managed "
                                    "environments, wheels, synced data), which `down` keeps."),
    stop_run: bool = typer.Option(False, "--stop-run",
                                  help="Stop a detached run that still runs (its outputs come here "
                                       "first); without it, `down` refuses while one runs."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Stop the cluster and leave nothing behind.

    Stops every task, checks that none remains, removes dtf's files from the hosts and forgets the
    cluster. With no cluster up, there is nothing to do.
    """
    from dtf import ui
    from dtf.hostops import lifecycle

    settle_detached(cluster, connect_timeout, stop_run=stop_run, grace=grace)
    result = lifecycle.down(cluster, keep_logs=keep_logs, grace=grace, connect_timeout=connect_timeout,
                            view=ui.host_progress, purge=purge, say=ui.say)
    if result is None:
        ui.say(f"no cluster named {cluster!r} is up: nothing to take down" if cluster else
               "no cluster is up: nothing to take down")
        return
    ui.say(f"cluster {result.cluster} is down: {result.stopped} server(s) stopped on "
           f"{len(result.outcomes)} host(s) in {result.seconds:.1f}s")
    if purge:
        ui.show_purged(result.outcomes)


def settle_detached(cluster: str | None, connect_timeout: float, *, stop_run: bool, grace: float) -> None:
    """Before a cluster is taken down (`down`, `up --replace`): its detached run's outputs come
    here; a run that still runs is refused, or stopped (`stop_run`). Nothing where none is up."""
    from dtf import ui
    from dtf.hostops import lifecycle

    try:
        record = lifecycle.recorded(cluster)
    except NoCluster:
        return
    if record.detached is not None:
        from dtf.detached.remote import settle
        from dtf.hostops.parallel import HostOps

        settle(record, HostOps(record.plan, connect_timeout=connect_timeout),
               lambda line: ui.say(f"dtf: {line}", stderr=True), stop_run=stop_run, grace=grace)


def main() -> None:
    """The `dtf` command (pyproject's [project.scripts], and `python -m dtf`)."""
    try:
        app()
    finally:
        # `train` runs the user's program in this process: its objects get the interpreter's
        # whole teardown, their finalizers with it.
        if sys.argv[1:2] != ["train"]:
            # What dtf made is closed by now (its with blocks ended): freezing spares Python's
            # teardown a collection that walks every object of the modules a command imported.
            gc.freeze()


if __name__ == "__main__":
    main()
