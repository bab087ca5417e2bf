"""Talking to the launcher on a host: every launcher command's reply is decoded once, here, into
the types of `dtf_server.protocol`; a host without this dtf's launcher gets it uploaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dtf.cluster.plan import HostPlan
from dtf.files import shipping
from dtf.hosts.base import CommandRunner, HostError, Result
from dtf_server import protocol
from dtf_server.protocol import ProtocolMismatch

if TYPE_CHECKING:
    from dtf_server.protocol import R

RENEW_TIMEOUT = 15.0  # seconds for a short launcher command (renew, a directory check)


class LauncherMissing(Exception):
    """The launcher is not at its path on the host (a new cluster, another dtf version's files,
    or the cluster's files were removed)."""


def decode(kind: type[R], result: Result, what: str) -> R:
    """The launcher's reply, typed; HostError if there is none."""
    if result.exit_code == protocol.EXIT_NO_LAUNCHER and not result.stdout.strip():
        raise LauncherMissing(what)
    try:
        return protocol.decode(kind, result.stdout)
    except ProtocolMismatch:
        raise
    except ValueError as e:
        err = (result.stderr.strip().splitlines() or [str(e)])[-1]
        raise HostError(f"{what} failed (exit {result.exit_code}): {err}")


def upload(t: CommandRunner, hp: HostPlan) -> None:
    t.put_bytes(shipping.launcher_bytes(), hp.root, shipping.launcher_name())


def ask(t: CommandRunner, hp: HostPlan, kind: type[R], argv: list[str], what: str, timeout: float,
        upload_if: Callable[[], bool] = lambda: True) -> R:
    """Run a launcher command and decode its reply. If this dtf's launcher is not there (or
    a launcher of another protocol answered), ship it, when `upload_if()`, and ask again."""
    try:
        return decode(kind, t.run(argv, timeout=timeout), what)
    except (LauncherMissing, ProtocolMismatch):
        if not upload_if():
            raise
    upload(t, hp)
    try:
        return decode(kind, t.run(argv, timeout=timeout), what)
    except (LauncherMissing, ProtocolMismatch) as e:
        raise HostError(f"{what} failed: the launcher just uploaded to {hp.launcher} "
                        f"{'is not there' if isinstance(e, LauncherMissing) else e}")


def root_exists(t: CommandRunner, hp: HostPlan) -> bool:
    return t.run(["test", "-d", hp.root], timeout=RENEW_TIMEOUT).ok
