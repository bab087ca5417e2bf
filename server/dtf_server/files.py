"""The launcher's file commands: `sync` (a synced tree, received from the laptop or another host:
dtf_server.receive), and managed environments (dtf_server.envs): `env` builds one, `serve-wheels`
and `fetch-wheels` pass their wheels from host to host, `purge` removes WORKDIR/.cache."""

from __future__ import annotations

import os
import sys
from argparse import Namespace

from dtf_server import envs, receive
from dtf_server.protocol import EnvReply, FetchReply, PurgeReply, ServeReply, SyncReply
from dtf_server.supervisor import running_tasks


def cmd_env(args: Namespace) -> EnvReply:
    return envs.build(args.env, args.wheels, args.uv, args.requirements)


def cmd_serve_wheels(args: Namespace) -> ServeReply:
    return envs.serve(args.dir, args.port, args.file, args.idle, args.limit)


def cmd_fetch_wheels(args: Namespace) -> FetchReply:
    files = [tuple(f.rsplit(":", 1)) for f in args.file]
    return envs.fetch(args.source, args.dir, [(n, h) for n, h in files], args.wait, args.timeout)


def cmd_purge(args: Namespace) -> PurgeReply:
    workdir = args.workdir
    clusters = [n for n in os.listdir(workdir) if not n.startswith(".")] if os.path.isdir(workdir) else []
    running = {n: running_tasks(os.path.join(workdir, n)) for n in clusters
               if os.path.isdir(os.path.join(workdir, n))}
    return envs.purge(workdir, running)



def cmd_sync(args: Namespace) -> SyncReply:
    """A synced tree: is WORKDIR/.cache/sync/HASH there (`--free-port`: and a port free here);
    with --receive, make it from stdin, or from another host's relay (`--from ADDR:PORT`), and
    pass it on to `--children` hosts as it arrives (`--serve PORT`: see dtf_server.receive)."""
    if receive.present(args.dir, args.hash) or not args.receive:
        return SyncReply(present=receive.present(args.dir, args.hash),
                         port=receive.free_port() if args.free_port else 0)
    token = args.token
    relay = None
    if args.serve:
        try:
            relay = receive.Relay(args.serve, args.children, token)
        except OSError:
            relay = None  # the port was taken meanwhile: the children fail, and the laptop sends to them
    complete = False
    try:
        wait = receive.ACCEPT_WAIT if args.wait is None else args.wait
        source = receive.connect(args.source, token, wait=wait) if args.source else sys.stdin.buffer
        if relay is not None:
            relay.accept(wait=wait)
        try:
            received = receive.receive(args.dir, args.hash, source, relay.write if relay is not None else None)
        finally:
            source.close()
        complete = True
    except receive.ReceiveError as e:
        raise SystemExit(f"sync: {e}")
    finally:
        if relay is not None:
            relay.close(complete)
    return SyncReply(present=True, received=received, passed=relay.passed if relay is not None else 0)


