"""The launcher's command line: `launcher COMMAND [OPTIONS]`, read into the command's typed request
(dtf_server.protocol: `parse`, its options from the request's fields), and the function that runs
it (in start.py, network.py, collective.py, detached.py, files.py, maintenance.py). Each prints one reply
(dtf_server.protocol) as JSON and exits 0 when it did what was asked; `launcher --help` lists the
commands, `launcher COMMAND --help` a command's options. A task's spec (`--task` of start,
check-start, run, run-step and supervise-program) is a protocol.TaskSpec as JSON: the task and
the exact command its supervisor runs (the plan's).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from dtf_server.protocol import (
    EXIT_START_FAILED,
    AuthorizeRequest,
    CheckRequest,
    CheckStartRequest,
    CleanRequest,
    DetachedRequest,
    EnvRequest,
    FakeRequest,
    FetchWheelsRequest,
    FollowRequest,
    LogRequest,
    PurgeRequest,
    ReachRequest,
    RenewRequest,
    Reply,
    Request,
    RunRequest,
    RunStepRequest,
    ServeRequest,
    ServeWheelsRequest,
    StartReply,
    StartRequest,
    StatusRequest,
    StopRequest,
    SuperviseProgramRequest,
    SyncRequest,
    TopRequest,
    encode,
    parse,
)

# Each command's function, MODULE.FUNCTION of this package: a command imports its own module
# only (see `command`).
RUNS: dict[type[Request], str] = {
    CheckRequest: "start.cmd_check",
    CheckStartRequest: "start.cmd_check_start",
    StartRequest: "start.cmd_start",
    ServeRequest: "start.cmd_serve",
    FakeRequest: "start.cmd_fake",
    StatusRequest: "maintenance.cmd_status",
    TopRequest: "maintenance.cmd_top",
    LogRequest: "maintenance.cmd_log",
    RenewRequest: "maintenance.cmd_renew",
    StopRequest: "maintenance.cmd_stop",
    CleanRequest: "maintenance.cmd_clean",
    ReachRequest: "network.cmd_reach",
    SyncRequest: "files.cmd_sync",
    EnvRequest: "files.cmd_env",
    PurgeRequest: "files.cmd_purge",
    ServeWheelsRequest: "files.cmd_serve_wheels",
    FetchWheelsRequest: "files.cmd_fetch_wheels",
    RunRequest: "collective.cmd_run",
    RunStepRequest: "collective.cmd_run_step",
    SuperviseProgramRequest: "collective.cmd_supervise_program",
    FollowRequest: "collective.cmd_follow",
    AuthorizeRequest: "detached.cmd_authorize",
    DetachedRequest: "detached.cmd_detached",
}


def command(name: str) -> Callable[[Any], Reply | None]:
    """The function MODULE.FUNCTION of this package. Every `up`, `status` and `down` runs a
    command on every host, in a python of its own: it imports what that command needs, not what
    the collective mode's or the managed environments' commands need."""
    module, function = name.split(".")
    run: Callable[[Any], Reply | None] = getattr(importlib.import_module(f"dtf_server.{module}"), function)
    return run


def main(argv: list[str] | None = None) -> int:
    request = parse(sys.argv[1:] if argv is None else argv)
    reply = command(RUNS[type(request)])(request)
    if reply is None:  # serve, fake, supervise-program, follow, top, log: they run until done
        return 0
    print(encode(reply), flush=True)
    if isinstance(request, StartRequest) and request.keep:
        from dtf_server.supervisor import keep

        keep()
    if isinstance(reply, StartReply) and not reply.ok:
        return EXIT_START_FAILED
    return 0
