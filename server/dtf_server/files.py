"""The launcher's file commands: `sync` (a synced tree, received from the laptop or another host:
dtf_server.receive), and managed environments (dtf_server.envs): `env` builds one, `serve-wheels`
and `fetch-wheels` pass their wheels from host to host, `purge` removes WORKDIR/.cache."""

from __future__ import annotations

import os
import sys

from dtf_server import envs, receive
from dtf_server.protocol import (
    Defaults,
    EnvReply,
    EnvRequest,
    FetchReply,
    FetchWheelsRequest,
    PurgeReply,
    PurgeRequest,
    ServeReply,
    ServeWheelsRequest,
    SyncReply,
    SyncRequest,
)
from dtf_server.supervisor import running_tasks


def cmd_env(request: EnvRequest) -> EnvReply:
    return envs.build(request.env, request.wheels, request.uv, request.requirements)


def cmd_serve_wheels(request: ServeWheelsRequest) -> ServeReply:
    return envs.serve(request.dir, request.port, request.file, request.idle, request.limit)


def cmd_fetch_wheels(request: FetchWheelsRequest) -> FetchReply:
    files = [tuple(f.rsplit(":", 1)) for f in request.file]
    return envs.fetch(request.source, request.dir, [(n, h) for n, h in files], request.wait, request.timeout)


def cmd_purge(request: PurgeRequest) -> PurgeReply:
    workdir = request.workdir
    clusters = [n for n in os.listdir(workdir) if not n.startswith(".")] if os.path.isdir(workdir) else []
    running = {n: running_tasks(os.path.join(workdir, n)) for n in clusters
               if os.path.isdir(os.path.join(workdir, n))}
    return envs.purge(workdir, running)



def cmd_sync(request: SyncRequest) -> SyncReply:
    """A synced tree: is WORKDIR/.cache/sync/HASH there (`--free-port`: and a port free here);
    with --receive, make it from stdin, or from another host's relay (`--from ADDR:PORT`), and
    pass it on to `--children` hosts as it arrives (`--serve PORT`: see dtf_server.receive)."""
    if receive.present(request.dir, request.hash) or not request.receive:
        return SyncReply(present=receive.present(request.dir, request.hash),
                         port=receive.free_port() if request.free_port else 0)
    token = request.token
    relay = None
    if request.serve:
        try:
            relay = receive.Relay(request.serve, request.children, token)
        except OSError:
            relay = None  # the port was taken meanwhile: the children fail, and the laptop sends to them
    complete = False
    try:
        wait = Defaults.RELAY_WAIT if request.wait is None else request.wait
        source = receive.connect(request.source, token, wait=wait) if request.source else sys.stdin.buffer
        if relay is not None:
            relay.accept(wait=wait)
        try:
            received = receive.receive(request.dir, request.hash, source, relay.write if relay is not None else None)
        finally:
            source.close()
        complete = True
    except receive.ReceiveError as e:
        raise SystemExit(f"sync: {e}")
    finally:
        if relay is not None:
            relay.close(complete)
    return SyncReply(present=True, received=received, passed=relay.passed if relay is not None else 0)


