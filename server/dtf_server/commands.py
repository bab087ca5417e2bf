"""The launcher's command line: each command's options, read by argparse, and the function that
runs it (in start.py, network.py, collective.py, files.py, maintenance.py). Each prints one
reply (dtf_server.protocol) as JSON and exits 0 when it did what was asked:

    check     --dir D --port P ... [--env E --wheels W]  versions, busy ports, the SSH client's
                                                   address, the platform; is managed environment E complete
    env       --env E --wheels W --uv U --requirements F  build managed environment E (dtf_server.envs)
    purge     --workdir W                          remove W/.cache (environments, wheels, synced trees)
    serve-wheels --dir W --port P --file NAME ... [--idle S]   serve those wheels to the other hosts
    fetch-wheels --from URL --dir W --file NAME:SHA256 ...    copy wheels from another host's serve-wheels
    start     --dir D --task SPEC ... [options]    start supervised servers detached, wait until each serves
                                                   (a supervisor forked per task: restarts its server when it dies);
                                                   --keep (a Slurm job step): then stay until they have ended;
                                                   --fence auto|members --fence-port P --allow A ...: first
                                                   close the TF ports to all but A (dtf_server.fence)
    serve     --job J --index I --port P --ready F [--full] (internal) run one tf.distribute.Server
    fake      --job J --index I --port P --ready F (tests) a server without TensorFlow: dtf_server.fake
    status    --dir D --task JOB:INDEX ... [--renew]  is each task alive, serving, restarted how often
    log       --dir D --task JOB:INDEX [--lines N] [--follow] [--all]  a task's last N lines, without
                                                   TensorFlow's own unless --all (dtf_server.tflog); --follow:
                                                   then new lines as they come, until the reader or the task goes
    renew     --dir D [--ttl S]                    renew the cluster's lease on this host
    stop      --dir D --task JOB:INDEX ... [--grace S]  TERM the task's process group, KILL after a grace
    clean     --dir D [--keep-logs] [--if-unused]  remove what dtf put in D (firewall rules too)
    reach     [--dir D] --to ADDR:PORT ... [--timeout S]  which targets this host cannot connect to; renews D's lease
    sync      --dir C --hash H [--receive]         whether C/H exists; --receive: make it from the pack on stdin
              [--from ADDR:PORT] [--serve P --children N] [--token T] [--wait S] [--free-port]: host to host
    run       --dir D --task SPEC ... [--env K=V] [--clear-output]  collective mode: start program copies
    supervise-program --dir D --task SPEC          (internal) run one program copy once (dtf_server.program)
    follow    --dir D --task JOB:INDEX [--beat S]  stream a program copy's output and events until it ends
    top       --dir D --task JOB:INDEX ... [--interval S] [--for S] [--states-only]  one TopSample line per interval
                                                   (status, CPU%, memory, network per task) until
                                                   its reader goes, or for S seconds (`dtf top`)

SPEC is a protocol.TaskSpec as JSON: the task and the exact command its supervisor runs (the plan's).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from dtf_server.protocol import EXIT_START_FAILED, EXIT_USAGE, Defaults, Reply, StartReply, encode


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error exits EXIT_USAGE with one line on stderr (2 means
    "no launcher there": see protocol.EXIT_NO_LAUNCHER), and options are never abbreviated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parser() -> Parser:
    """The launcher's parser: every command's options; `run` names the command's function,
    MODULE.FUNCTION in this package (a command imports its own module only: see `command`)."""
    p = Parser(prog="launcher", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def add(name: str, run: str) -> argparse.ArgumentParser:
        c = commands.add_parser(name)
        c.set_defaults(run=run, parser=c)
        return c

    def many(c: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
        c.add_argument(flag, action="append", default=[], **kwargs)  # repeated: one value each

    c = add("check", "start.cmd_check")
    c.add_argument("--dir")
    many(c, "--port", type=int)
    c.add_argument("--env")
    c.add_argument("--wheels")
    c = add("env", "files.cmd_env")
    for option in ("--env", "--wheels", "--uv", "--requirements"):
        c.add_argument(option, required=True)
    c = add("purge", "files.cmd_purge")
    c.add_argument("--workdir", required=True)
    c = add("serve-wheels", "files.cmd_serve_wheels")
    c.add_argument("--dir", required=True)
    c.add_argument("--port", type=int, required=True)
    many(c, "--file")
    c.add_argument("--idle", type=float, default=15.0)
    c.add_argument("--limit", type=float, default=900.0)
    c = add("fetch-wheels", "files.cmd_fetch_wheels")
    c.add_argument("--from", dest="source", required=True)
    c.add_argument("--dir", required=True)
    many(c, "--file")
    c.add_argument("--wait", type=float, default=30.0)
    c.add_argument("--timeout", type=float, default=30.0)
    for name, run in (("start", "start.cmd_start"), ("check-start", "start.cmd_check_start")):
        c = add(name, run)
        c.add_argument("--dir", required=True)
        if name == "check-start":
            many(c, "--port", type=int)
            c.add_argument("--tensorflow", default="")  # the laptop's version ("": not compared)
            c.add_argument("--fresh", action="store_true")  # a task of this cluster running there refuses
            c.add_argument("--gpus", type=int, default=0)  # GPUs the tasks are given (highest id + 1)
        many(c, "--task")
        c.add_argument("--restart-limit", type=int, default=Defaults.RESTART_LIMIT)
        c.add_argument("--restart-backoff", type=float, default=Defaults.RESTART_BACKOFF)
        many(c, "--env")
        c.add_argument("--timeout", type=float, default=Defaults.START_TIMEOUT)
        c.add_argument("--ttl", type=float, default=Defaults.TTL)
        # `up`'s mesh check in the same call: once these servers serve, the other hosts' tasks.
        many(c, "--reach")
        c.add_argument("--reach-timeout", type=float, default=5.0)
        # The mesh check once told: see start.cmd_start.
        c.add_argument("--reach-when-told", type=float, default=0.0)
        # A Slurm node's job step: after the reply, stay until the supervisors forked here end.
        c.add_argument("--keep", action="store_true")
        # The TF ports' firewall rules (dtf_server.fence), set before any server starts.
        c.add_argument("--fence", choices=("off", "auto", "members"), default="off")
        many(c, "--fence-port", type=int)  # every task port of the host (a repair starts only some)
        many(c, "--allow")
        c.add_argument("--allow-client", action="store_true")  # and the SSH client (the laptop)
        c.add_argument("--allow-launch-node", action="store_true")  # Slurm: and the step's srun host
    for name, run in (("serve", "start.cmd_serve"), ("fake", "start.cmd_fake")):
        c = add(name, run)
        c.add_argument("--job", required=True)
        c.add_argument("--index", type=int, required=True)
        c.add_argument("--port", type=int, required=True)
        c.add_argument("--ready", required=True)
        if name == "serve":
            c.add_argument("--full", action="store_true")  # `import tensorflow`: see dtf_server.tfserve
        if name == "fake":
            c.add_argument("--ready-delay", type=float, default=0.0)
            c.add_argument("--ignore-term", action="store_true")
            c.add_argument("--ready-file")
    c = add("run", "collective.cmd_run")
    c.add_argument("--dir", required=True)
    many(c, "--task")
    many(c, "--env")
    c.add_argument("--clear-output", action="store_true")
    c.add_argument("--spawned", default="")  # Slurm: `run-step` started the copies with this token
    c = add("run-step", "collective.cmd_run_step")
    c.add_argument("--dir", required=True)
    many(c, "--task")
    many(c, "--host")
    many(c, "--env")
    c.add_argument("--token", required=True)
    c.add_argument("--clear-output", action="store_true")
    c = add("supervise-program", "collective.cmd_supervise_program")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", required=True)
    c = add("follow", "collective.cmd_follow")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", required=True)
    c.add_argument("--beat", type=float, default=2.0)
    c = add("top", "maintenance.cmd_top")
    c.add_argument("--dir", required=True)
    many(c, "--task")
    c.add_argument("--interval", type=float, default=1.0)
    c.add_argument("--for", dest="for_seconds", type=float, default=24 * 3600.0)
    c.add_argument("--states-only", action="store_true")
    c = add("log", "maintenance.cmd_log")
    c.add_argument("--dir", required=True)
    c.add_argument("--task", required=True)
    c.add_argument("--lines", type=int, default=100)
    c.add_argument("--follow", action="store_true")
    c.add_argument("--all", action="store_true")
    c = add("renew", "maintenance.cmd_renew")
    c.add_argument("--dir", required=True)
    c.add_argument("--ttl", type=float, default=None)
    c = add("status", "maintenance.cmd_status")
    c.add_argument("--dir", required=True)
    many(c, "--task")
    c.add_argument("--renew", action="store_true")
    c = add("stop", "maintenance.cmd_stop")
    c.add_argument("--dir", required=True)
    many(c, "--task")
    c.add_argument("--grace", type=float, default=Defaults.STOP_GRACE)
    c.add_argument("--clean", action="store_true")  # `down` in one round trip: once every task is gone
    c.add_argument("--keep-logs", action="store_true")
    c = add("clean", "maintenance.cmd_clean")
    c.add_argument("--dir", required=True)
    c.add_argument("--keep-logs", action="store_true")
    c.add_argument("--if-unused", action="store_true")
    c = add("reach", "network.cmd_reach")
    c.add_argument("--dir")
    many(c, "--to")
    c.add_argument("--timeout", type=float, default=3.0)
    c = add("sync", "files.cmd_sync")
    c.add_argument("--dir", required=True)
    c.add_argument("--hash", required=True)
    c.add_argument("--receive", action="store_true")
    c.add_argument("--free-port", action="store_true")
    c.add_argument("--from", dest="source")
    c.add_argument("--serve", type=int, default=0)
    c.add_argument("--children", type=int, default=0)
    c.add_argument("--token", default="")
    c.add_argument("--wait", type=float)  # for the parent, and the children (default: receive.ACCEPT_WAIT)
    return p


def command(name: str) -> Callable[[argparse.Namespace], Reply | None]:
    """The function MODULE.FUNCTION of this package. Every `up`, `status` and `down` runs a
    command on every host, in a python of its own: it imports what that command needs, not what
    the collective mode's or the managed environments' commands need."""
    module, function = name.split(".")
    run: Callable[[argparse.Namespace], Reply | None] = getattr(
        importlib.import_module(f"dtf_server.{module}"), function)
    return run


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra:  # said by the command's parser, which names the command
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for attr in ("dir", "ready", "env", "wheels", "uv", "requirements", "workdir"):
        if isinstance(getattr(args, attr, None), str):  # (start's --env is a list of variables)
            setattr(args, attr, os.path.expanduser(getattr(args, attr)))
    reply: Reply | None = command(args.run)(args)
    if reply is None:  # serve, fake, supervise-program, follow, top: they run until done
        return 0
    print(encode(reply), flush=True)
    if getattr(args, "keep", False):
        from dtf_server.start import keep

        keep()
    if isinstance(reply, StartReply) and not reply.ok:
        return EXIT_START_FAILED
    return 0
