"""The `dtf` command's entry point (pyproject's [project.scripts], and `python -m dtf`).

What can begin before the CLI has loaded (typer and the modules of the command: 0.1-0.2 s of a
command's start) begins here; then dtf.cli runs. That is `dtf up`'s SSH handshakes (0.2-0.3 s
each), which then overlap the CLI's loading:
- Where the last `up` of the same, unchanged inventory file started masters (to its hosts, or to
  a Slurm inventory's login host), their ssh start first of all, before the inventory is read
  (dtf.hosts.spawn); each master `up` then asks for takes its ssh over when it would run the same,
  and one no `up` took is closed on the way out. What this `up` started is remembered then, for
  the next.
- `dtf up` of an inventory of hosts reads their ssh_config settings (`ssh -G`, for the plan's
  addresses) in a thread as soon as the inventory is read (dtf.hosts.openssh.begin_prefetch).
- `dtf up` of a Slurm inventory also opens the login host's master in a thread as soon as the
  inventory is read (dtf.hostops.slurm.HeadStart), for the first `up` of the file; `up` takes it
  over once it has read its arguments as the CLI reads them (HeadStart.take: the same inventory,
  timeout and ttl), and one `up` did not take (it failed before, or asked otherwise) is closed on
  the way out.

The command line is read here only where it is plainly `dtf up INVENTORY` with the options below:
anything else (--help, --dry-run, --replace, an option this does not know, a second argument, an
inventory that does not load) starts nothing early, and the CLI says what it says.
"""

from __future__ import annotations

import sys

# `dtf up`'s options that take a value (the head start needs --ttl and --connect-timeout's).
_UP_OPTIONS = ("--ttl", "--connect-timeout", "--network", "--slurm-wait")


def up_arguments(argv: list[str]) -> tuple[str, float | None, float | None] | None:
    """(inventory, --connect-timeout, --ttl in seconds) of a plain `dtf up INVENTORY [OPTIONS]`
    (None where not given); None for any other command line (see the module's doc)."""
    if argv[:1] != ["up"]:
        return None
    inventory: str | None = None
    values: dict[str, str] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if arg.startswith("-"):
            name, eq, value = arg.partition("=")
            if name not in _UP_OPTIONS:
                return None
            if not eq:
                given = next(rest, None)
                if given is None:
                    return None
                value = given
            values[name] = value
        elif inventory is None:
            inventory = arg
        else:
            return None
    if inventory is None:
        return None
    from dtf.cluster.durations import parse_duration

    try:
        timeout = float(values["--connect-timeout"]) if "--connect-timeout" in values else None
        ttl = parse_duration(values["--ttl"], "--ttl") if "--ttl" in values else None
    except Exception:  # (the CLI says what is wrong with them)
        return None
    return inventory, timeout, ttl


def begin_early(argv: list[str]) -> None:
    """Start what the command line lets start before the CLI (see the module's doc). A Ctrl-C
    meanwhile is raised once it is done (see _begin_early)."""
    args = up_arguments(argv)
    if args is None:
        return
    import signal

    interrupted: list[int] = []
    try:  # (not in the main thread, or SIGINT ignored by whoever started dtf: as it was)
        deferring = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if deferring:
            signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    except ValueError:
        deferring = False
    try:
        _begin_early(*args)
    finally:
        if deferring:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt


def _begin_early(path: str, timeout: float | None, ttl: float | None) -> None:
    """begin_early's work, with a Ctrl-C held until it is done: a KeyboardInterrupt raised inside
    an import, while the head start's thread imports too, can leave the module's import lock
    held by this thread (importlib's own release is interrupted): that thread then waits for it
    forever, and the command's end, which waits for that thread, with it. Held here, it comes
    0.1-0.2 s later, with the head start begun and known, so that it is abandoned."""
    from dtf.hosts import spawn

    # The master the last `up` of this unchanged file started, before even the inventory is read
    # (its parser and the modules that build the ssh command line: 0.08-0.15 s): HeadStart's
    # master takes it over where it would run the same ssh.
    spawn.begin(path, timeout, ttl)
    from dtf.cluster.inventory import load

    try:
        inv = load(path)
    except Exception:  # the CLI loads it again, and says what is wrong with it
        return
    if inv.slurm is None:  # the hosts' `ssh -G` (the plan's addresses) run while the CLI loads
        from dtf.hosts.openssh import begin_prefetch

        begin_prefetch(list(inv.hosts), inv.ssh_config)
        return
    from dtf.hostops.slurm import HeadStart
    from dtf.hosts.netutil import CONNECT_TIMEOUT

    HeadStart.begin_early(inv, CONNECT_TIMEOUT if timeout is None else timeout, ttl)


def main() -> None:
    try:
        begin_early(sys.argv[1:])
        from dtf import cli

        cli.main()
    except KeyboardInterrupt:  # before the CLI had loaded (it says so itself after)
        sys.stderr.write("dtf: error: interrupted\n")
        sys.exit(130)
    finally:
        slurm = sys.modules.get("dtf.hostops.slurm")  # (a command that never loaded it began nothing)
        if slurm is not None:
            slurm.HeadStart.abandon_all()
        spawn = sys.modules.get("dtf.hosts.spawn")
        if spawn is not None:
            spawn.keep()
            spawn.abandon()
