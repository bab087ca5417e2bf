"""The `dtf` command. This module only parses, calls and prints: the lifecycle of a cluster
(start with rollback, repair, teardown, the record) lives in `lifecycle`, running a program in
`train`, what things look like in `ui`. Expected failures (DtfError) become one red line and an exit code here;
anything else is a bug: one line on screen, the traceback in $DTF_HOME/debug.log.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dtf.cluster import state
from dtf.cluster.durations import parse_duration
from dtf.errors import ClusterDown, DtfError, ExitCode, HostFailure, UsageError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf_server.protocol import Defaults

if TYPE_CHECKING:
    from dtf.cluster.inventory import Inventory
    from dtf.cluster.slurm import Allocation
    from dtf.cluster.state import Record

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


def _recorded(cluster: str | None) -> Record:
    with state.locked():
        return state.load(state.resolve_name(cluster))


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
    slurm_wait: float = typer.Option(600.0, "--slurm-wait",
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
    if inv.slurm is not None and dry_run:
        ui.show_slurm_plan(inv)
        return
    allocation, fresh = None, False
    if inv.slurm is not None:
        allocation, fresh = _slurm_allocation(inv, inventory, slurm_wait, connect_timeout, replace, ttl_seconds,
                                              network)
    from dtf.hostops import lifecycle

    try:
        plan = lifecycle.load_plan(inventory, ttl_seconds, os.environ.get(lifecycle.SERVER_ENV) or "tensorflow",
                                   network=network, slurm=allocation, inv=inv, config_checked=inv.slurm is not None)
        if dry_run:
            ui.show_plan(plan)
            return
        from dtf.files import sync

        ui.load_tables()  # for the table shown at the end
        with sync.packed([(item.name, item.path) for item in plan.sync]) as packs:
            ui.show_packs(packs)
            result = lifecycle.up(plan, inventory, ttl=ttl_seconds, replace=replace,
                                  connect_timeout=connect_timeout, view=ui.host_progress, packs=packs)
    except BaseException:
        if allocation is not None and fresh:  # an allocation made for an `up` that failed is not kept
            from dtf.hostops.slurm import release

            release(allocation, inv.ssh_config, ui.say, connect_timeout, cluster=inv.cluster)
        raise
    ui.show_up_result(result)


def _slurm_allocation(inv: Inventory, inventory: Path, wait: float, connect_timeout: float, replace: bool,
                      ttl: float | None, network: str | None) -> tuple[Allocation, bool]:
    """`up`'s allocation of a Slurm inventory (lifecycle.slurm_allocation), over the login host's
    master opened while the rest of dtf loads: begun before the CLI (dtf.entry) or now; not with
    `replace`, which tears the recorded cluster down first, its masters with it."""
    from dtf import ui
    from dtf.hostops.slurm import HeadStart

    try:
        head = None if replace else HeadStart.take(inv, connect_timeout, ttl) or HeadStart(inv, connect_timeout, ttl)
        if inv.ssh_config:  # (meanwhile: the file's mistakes at its line, not as ssh's failure)
            from dtf.hosts.transport import check_ssh_config

            check_ssh_config(inventory, inv.ssh_config)
        from dtf.hostops import lifecycle

        return lifecycle.slurm_allocation(inv, inventory, wait=wait, say=ui.say, connect_timeout=connect_timeout,
                                          replace=replace, view=ui.host_progress, ttl=ttl, head=head,
                                          server=os.environ.get(lifecycle.SERVER_ENV) or "tensorflow",
                                          network=network)
    except BaseException:
        # The master it opened, unless the allocation took it (it closes it then); also where a
        # Ctrl-C came while HeadStart began, before `head` was set.
        HeadStart.abandon_all()
        raise


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
                                      "it to serve again and runs the program again (it resumes "
                                      "from its last checkpoint)."),
    ps_wait: float = typer.Option(120.0, "--ps-wait", help="Seconds to wait for a lost ps to serve again."),
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
) -> None:
    """Run PROGRAM as the coordinator of the cluster.

    PROGRAM runs here, as the chief of the cluster (with --collective: on the hosts, one copy per
    worker). dtf exits with the program's exit code.
    """
    from dtf.program.hooks import packing as packing_hook
    from dtf.program.hooks import wrap as wrap_hook
    from dtf.program.train import run_program

    hook_env = {packing_hook.ENV: "auto" if packing else "off"}
    if wrap:
        hook_env[wrap_hook.ENV] = "1"

    if not program.is_file():
        raise UsageError(f"program not found: {program}")
    if collective:
        from dtf.collective.run import run_collective
        from dtf.program.train import taken_down

        record = _recorded(cluster)
        raise typer.Exit(run_collective(record, str(program), list(args or []), str(output) if output else None,
                                        attempts=attempts, join_timeout=join_timeout,
                                        connect_timeout=connect_timeout, taken_down=lambda: taken_down(record),
                                        verbose=verbose))
    code = run_program(_recorded(cluster), str(program), list(args or []),
                       str(output) if output else None, attempts=attempts, ps_wait=ps_wait,
                       connect_timeout=connect_timeout, verbose=verbose, hook_env=hook_env)
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
    cluster = _recorded(cluster).cluster  # no cluster: say so before packing anything
    with sync.packed([(name, str(path))]) as packs:
        ui.show_packs(packs)
        _, reports = lifecycle.sync_to(cluster, packs, connect_timeout=connect_timeout, view=ui.host_progress)
    for report in reports:
        ui.out.print(report.line(), markup=False)


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
    from dtf import ui
    from dtf.hostops import status
    from dtf.hostops.parallel import HostOps

    record = _recorded(cluster)
    job = None
    if record.plan.slurm is not None:
        from dtf.hostops.slurm import allocation_state

        job, ended = allocation_state(record.plan.slurm, record.cluster, record.plan.ssh_config, record.plan.ttl,
                                      connect_timeout)
        if ended is not None:  # the nodes are not ours (or not there) any more: nothing to ask them
            ui.show_status(record, [], json_out, job, ended)
            raise ClusterDown(f"cluster {record.cluster!r}: {ended}" + (" (`dtf down` forgets it)" if
                                                                       job.state != "RUNNING" else ""))
    ui.load_tables()
    rows = ui.status_rows(status.states(HostOps(record.plan, connect_timeout=connect_timeout)))
    ui.show_status(record, rows, json_out, job)
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
    from dtf.hostops.parallel import HostOps
    from dtf.hostops.watch import Watch
    from dtf.program import figures

    if not 0.1 <= interval <= 3600:
        raise UsageError(f"--interval: expected seconds between 0.1 and 3600, got {interval:g}")
    if not (once or json_out) and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("dtf top: not a terminal: pass --once or --json for one snapshot")
    from rich.console import Console

    record = _recorded(cluster)
    plan = record.plan
    live_dir = figures.live_dir(state.home(), plan.cluster)
    # Not ui.out: a soft-wrapping console squeezes the table to 80 columns.
    console = Console(highlight=False, emoji=False, width=None if sys.stdout.isatty() else 200)
    with Watch(HostOps(plan, connect_timeout=connect_timeout), interval) as watch:
        if not (once or json_out):
            view.live(plan, watch, live_dir, interval, console)
            return
        # Two samples per host: CPU% and the byte rates are differences between two.
        watch.wait_samples(2, timeout=connect_timeout + 2 * interval + 15)
        doc = view.snapshot(plan, watch.feeds(), view.training(live_dir))
    if json_out:
        import json

        ui.out.print_json(json.dumps(doc))
    else:
        console.print(view.view(doc, height=console.size.height if console.is_terminal else 10**6))
    if any(r["state"] != "alive" for r in doc["tasks"]):
        raise typer.Exit(int(ExitCode.CLUSTER_DOWN))


@app.command()
@guarded
def logs(
    task: str = typer.Argument(..., metavar="TASK", help="The task, e.g. worker:1 or ps:0."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(100, "--lines", "-n", help="How many last lines to print."),
    cluster: str | None = ClusterOpt,
) -> None:
    """Print a task's log from its host."""
    from dtf.hostops.parallel import HostOps
    from dtf.hosts.transport import HostError

    plan = _recorded(cluster).plan
    t = plan.task(task)
    if t is None:
        raise UsageError(f"cluster {plan.cluster!r} has no task {task!r} "
                         f"(tasks: {', '.join(x.name for x in plan.tasks())})")
    hp = plan.host_of(t)
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), t.log]
    ended_by: list[int] = []
    try:
        # SIGTERM and SIGHUP end it as Ctrl-C does: the stream's ssh (and with it the remote tail)
        # is stopped, not left running after dtf.
        with HostOps(plan).transport(hp) as conn, _signals_interrupt(ended_by):
            conn.run(hp.renew_argv(), timeout=15)  # reading a log is using the cluster
            code = conn.stream(argv)
    except HostError as e:
        raise HostFailure("dtf logs", {hp.name: str(e)})
    raise typer.Exit(128 + ended_by[0] if ended_by else code)


@contextlib.contextmanager
def _signals_interrupt(received: list[int]) -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise KeyboardInterrupt (the signal noted in `received`)."""
    def interrupt(signum: int, frame: object) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@app.command()
@guarded
def down(
    cluster: str | None = ClusterOpt,
    keep_logs: bool = typer.Option(False, "--keep-logs", help="Leave the task logs on the hosts."),
    grace: float = typer.Option(Defaults.STOP_GRACE, help="Seconds between TERM and KILL."),
    purge: bool = typer.Option(False, "--purge",
                               help="Also remove each host's cache (WORKDIR/.cache: managed "
                                    "environments, wheels, synced data), which `down` keeps."),
    connect_timeout: float = ConnectTimeoutOpt,
) -> None:
    """Stop the cluster and leave nothing behind.

    Stops every task, checks that none remains, removes dtf's files from the hosts and forgets the
    cluster. With no cluster up, there is nothing to do.
    """
    from dtf import ui
    from dtf.hostops import lifecycle

    result = lifecycle.down(cluster, keep_logs=keep_logs, grace=grace, connect_timeout=connect_timeout,
                            view=ui.host_progress, purge=purge, say=ui.say)
    if result is None:
        ui.say(f"no cluster named {cluster!r} is up: nothing to take down" if cluster else
               "no cluster is up: nothing to take down")
        return
    ui.out.print(f"cluster {result.cluster} is down: {result.stopped} server(s) stopped on "
                 f"{len(result.outcomes)} host(s) in {result.seconds:.1f}s", markup=False)
    if purge:
        ui.show_purged(result.outcomes)


def main() -> None:
    try:
        app()
    finally:
        # `train` runs the user's program in this process: its objects get the interpreter's
        # whole teardown, their finalizers with it.
        if sys.argv[1:2] != ["train"]:
            # Python's teardown collects every object of the ~300 modules a command imported: 40-100
            # ms of a `dtf up` or `dtf status` (measured: 10 ms after gc.freeze). What dtf made is
            # closed by now (its with blocks ended); freezing only spares the collector that walk.
            gc.freeze()


if __name__ == "__main__":  # (`python -m dtf` begins what it can before this module loads: dtf.entry)
    main()
