"""The host protocol: what each launcher command answers, typed once for both sides.

The launcher (this package, on a host) prints exactly one JSON document per command: the reply's
fields and `"protocol": PROTOCOL`. The client (`dtf.hostops.launcher`) decodes it with `decode()`
into the same frozen dataclasses, so neither side reads raw keys.
A reply of another protocol version is refused (`ProtocolMismatch`), never half-read: the client
then ships its own launcher and asks again.

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

# Bump on any change of a command's arguments or of a reply's fields: a reply of another version
# is refused, never half-read (what each version changed: this file's git log).
PROTOCOL = 14

# Exit codes of the launcher's commands (besides 0). Python itself exits 2 when it cannot open
# the launcher file: `python MISSING.pyz` prints "can't open file" and produces no JSON. The
# launcher never exits 2 itself (argparse would, for a usage error: it exits EXIT_USAGE instead),
# so 2 with no reply means "no launcher there".
EXIT_NO_LAUNCHER = 2
EXIT_START_FAILED = 1  # `start`: a server did not come up (its reply says which and why)
EXIT_USAGE = 64  # a command line the launcher does not understand (sysexits' EX_USAGE)


class Defaults:
    """Host-side defaults, in one place: the plan and the launcher both use these."""

    START_TIMEOUT = 90.0  # seconds a host's servers get to import TensorFlow and serve
    STOP_GRACE = 10.0  # seconds `stop` gives a task's process group between TERM and KILL
    SERVER_STOP_GRACE = 5.0  # seconds a supervisor gives its server after TERM, then KILL
    RESTART_LIMIT = 10  # restarts of a dead server before its supervisor gives up
    RESTART_BACKOFF = 0.5  # seconds before the first restart; doubles for quick deaths
    RESTART_MAX_BACKOFF = 60.0
    STABLE_AFTER = 60.0  # a server that ran this long before dying restarts with the base backoff
    TTL = 3600.0  # the lease: seconds without renewal before the tasks stop themselves


class ProtocolMismatch(Exception):
    """A reply from a launcher that speaks another protocol version."""

    def __init__(self, found: object) -> None:
        super().__init__(f"the launcher there speaks protocol {found!r}, this dtf speaks {PROTOCOL}")
        self.found = found


# -- commands' arguments ----------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    """One task as `start` and its supervisor get it: the plan's exact serve command included."""

    job: str
    index: int
    port: int
    argv: list[str]  # what the supervisor runs (a leading ~/ is expanded as a shell would)

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"

    def to_arg(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_arg(cls, text: str) -> TaskSpec:
        data = json.loads(text)
        return cls(job=str(data["job"]), index=int(data["index"]), port=int(data["port"]),
                   argv=[str(a) for a in data["argv"]])


# -- replies ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckReply:
    python: str  # the version of the python that runs the launcher
    executable: str
    tensorflow: str | None  # its TensorFlow version (package metadata), None if not installed
    busy: list[int]  # planned ports already taken
    client_address: str | None  # the SSH client's address as the host sees it (the laptop's)
    running: list[str]  # tasks (JOB:INDEX) alive in this cluster's directory
    # The platform, for a managed environment's wheels: platform.machine(), platform.system(),
    # "glibc 2.36" ("" when not glibc), and whether the environment asked for (`check --env`)
    # is complete and built on this python; if not, the wheels already on the host (WORKDIR/.cache/wheels).
    machine: str = ""
    system: str = ""
    libc: str = ""
    env_ready: bool | None = None  # None: no environment was asked about
    wheels: list[str] = field(default_factory=list)
    free: int = -1  # bytes free where the wheels and environments go (-1: not asked)
    gpus: int | None = None  # GPUs the host's NVIDIA driver lists (procs.nvidia_gpus); None: no driver


@dataclass(frozen=True)
class TaskStarted:
    ok: bool
    pid: int | None  # the supervisor's
    already: bool = False  # it was running (the same port): left alone
    reason: str | None = None  # why it did not come up
    log_tail: list[str] = field(default_factory=list)
    server_pid: int | None = None  # the server's, once it serves (what `dtf up` and `dtf status` show)


@dataclass(frozen=True)
class StartReply:
    tasks: dict[str, TaskStarted]
    # `start --reach`: the other hosts' tasks this host could not connect to (None: not asked,
    # or a task of its own did not start)
    unreachable: dict[str, str] | None = None
    # `start --fence`: the TF ports' firewall rules it set first, or why it could not (None: not asked)
    fence: FenceReply | None = None
    refused: str | None = None  # why it started nothing (`--fence members` where rules cannot be set)

    @property
    def ok(self) -> bool:
        return self.refused is None and all(t.ok for t in self.tasks.values())


@dataclass(frozen=True)
class Lease:
    ttl: float  # 0: never lapses
    renewed: float  # time.time() on the host


@dataclass(frozen=True)
class TaskStatus:
    """A task as its host sees it."""

    alive: bool  # its supervisor runs
    phase: str  # the supervisor's: starting, running, restarting, failed; or dead
    pid: int | None  # the supervisor's
    server_pid: int | None  # the server's, while it runs
    uptime: float | None  # of the server, since its last (re)start
    serving: bool  # the task's port accepts connections on its host
    restarts: int = 0
    last_exit: str | None = None  # "killed by SIGKILL", "exited with code 1"
    reason: str | None = None  # why it is not alive

    @classmethod
    def dead(cls, reason: str) -> TaskStatus:
        return cls(alive=False, phase="dead", pid=None, server_pid=None, uptime=None, serving=False,
                   reason=reason)

    @property
    def state(self) -> str:
        """THE decision of what a task is: alive (serving), restarting (its supervisor brings
        the server back), failed (the supervisor gave up), dead (nothing runs)."""
        if not self.alive:
            return "dead"
        if self.serving:
            return "alive"
        return "failed" if self.phase == "failed" else "restarting"

    @property
    def incarnation(self) -> tuple[int, int | None]:
        """What changes when the task's server is restarted."""
        return self.restarts, self.server_pid


@dataclass(frozen=True)
class StatusReply:
    tasks: dict[str, TaskStatus]
    lease: Lease | None


@dataclass(frozen=True)
class RenewReply:
    lease: Lease | None  # None: the cluster's files are gone (a lapsed lease removed them)


@dataclass(frozen=True)
class TaskStopped:
    was_running: bool
    killed: bool = False  # it needed KILL
    gone: bool = True  # nothing of it runs now


@dataclass(frozen=True)
class CleanReply:
    removed: list[str]
    in_use: bool = False  # --if-unused, and tasks (another dtf's) live there: nothing removed


@dataclass(frozen=True)
class StopReply:
    tasks: dict[str, TaskStopped]
    cleaned: CleanReply | None = None  # `stop --clean`, once every task was gone


@dataclass(frozen=True)
class ReachReply:
    """`reach`: which targets ("addr:port") this host could not open a TCP connection to."""

    unreachable: dict[str, str]  # target -> why ("timed out", "Connection refused")


@dataclass(frozen=True)
class FenceReply:
    """`fence`: the TF ports' firewall rules on this host (set, or removed)."""

    tool: str | None  # "nft" or "iptables"; None: no rules (removed, or there were none)
    error: str | None = None  # why rules could not be set (no root, no nft or iptables)


@dataclass(frozen=True)
class SyncReply:
    """`sync`: whether the host holds a synced tree (WORKDIR/.cache/sync/HASH), and how many bytes
    it just received to make it (0: it had it, or `--receive` was not asked). `port`
    (`--free-port`): a TCP port free on the host just now, for it to pass a pack on to other
    hosts from; `passed`: the hosts it passed the whole stream on to (`--serve`)."""

    present: bool
    received: int = 0
    port: int = 0
    passed: int = 0


@dataclass(frozen=True)
class EnvReply:
    """`env`: a managed environment built (or found complete: another dtf built it meanwhile)."""

    ok: bool
    error: str | None = None  # one line: why it could not be built ("disk full ...")
    seconds: dict[str, float] = field(default_factory=dict)  # phase (create, install) -> seconds
    size: int = 0  # bytes on disk
    reused: bool = False  # it was complete when the command started


@dataclass(frozen=True)
class PurgeReply:
    """`purge`: WORKDIR/.cache removed (managed environments, wheels, synced trees)."""

    removed: list[str]
    size: int = 0  # bytes freed
    error: str | None = None  # why something could not be removed


@dataclass(frozen=True)
class ServeReply:
    """`serve-wheels`: the seed's file server ended (no request for a while)."""

    requests: int
    bytes: int
    error: str | None = None


@dataclass(frozen=True)
class FetchReply:
    """`fetch-wheels`: the wheels copied from the seed, in order; `error`: why it stopped."""

    fetched: list[str]
    error: str | None = None


@dataclass(frozen=True)
class TaskSample:
    """One task in a `top` sample: its status, and what it uses (None: not known yet, the first
    sample of a stream, or not measurable there)."""

    status: TaskStatus
    cpu: float | None = None  # percent of one core, its whole process group
    rss: int | None = None  # bytes resident, its whole process group
    net_in: float | None = None  # bytes per second received on its TCP connections
    net_out: float | None = None  # bytes per second sent
    train: dict[str, Any] | None = None  # collective mode: the copy's figures (dtf.program.figures)


@dataclass(frozen=True)
class TopSample:
    """`top`: one line of its stream, every interval, for every task of the host."""

    tasks: dict[str, TaskSample]
    time: float  # time.time() on the host
    lease: Lease | None = None


Reply = (CheckReply | StartReply | StatusReply | RenewReply | StopReply | CleanReply | ReachReply | FenceReply
         | SyncReply | EnvReply | PurgeReply | ServeReply | FetchReply | TopSample)
R = TypeVar("R", CheckReply, StartReply, StatusReply, RenewReply, StopReply, CleanReply, ReachReply,
                FenceReply, SyncReply, EnvReply, PurgeReply, ServeReply, FetchReply, TopSample)


def encode(reply: Reply) -> str:
    return json.dumps({"protocol": PROTOCOL, **asdict(reply)})


def _lease(data: Any) -> Lease | None:
    return None if data is None else Lease(ttl=float(data["ttl"]), renewed=float(data["renewed"]))


def decode(kind: type[R], text: str) -> R:
    """The reply in `text` (a launcher's stdout: the last line is the JSON document).

    Raises ValueError if there is none or it is malformed, ProtocolMismatch if it is another
    protocol version's."""
    lines = text.strip().splitlines()
    if not lines:
        raise ValueError("no reply")
    data = json.loads(lines[-1])
    if not isinstance(data, dict):
        raise ValueError(f"not a reply: {lines[-1][:200]}")
    if data.get("protocol") != PROTOCOL:
        raise ProtocolMismatch(data.get("protocol"))
    try:
        if kind is StartReply:
            fenced = data.get("fence")
            return StartReply(tasks={n: TaskStarted(**t) for n, t in data["tasks"].items()},  # type: ignore[return-value]
                              unreachable=data.get("unreachable"),
                              fence=FenceReply(**fenced) if fenced is not None else None,
                              refused=data.get("refused"))
        if kind is StatusReply:
            return StatusReply(tasks={n: TaskStatus(**t) for n, t in data["tasks"].items()},  # type: ignore[return-value]
                               lease=_lease(data["lease"]))
        if kind is TopSample:
            return TopSample(  # type: ignore[return-value]
                tasks={n: TaskSample(**{**t, "status": TaskStatus(**t["status"])}) for n, t in data["tasks"].items()},
                time=float(data["time"]), lease=_lease(data.get("lease")))
        if kind is RenewReply:
            return RenewReply(lease=_lease(data["lease"]))  # type: ignore[return-value]
        if kind is StopReply:
            cleaned = data.get("cleaned")
            return StopReply(tasks={n: TaskStopped(**t) for n, t in data["tasks"].items()},  # type: ignore[return-value]
                             cleaned=CleanReply(**cleaned) if cleaned is not None else None)
        names = {f.name for f in fields(kind)}
        return kind(**{k: v for k, v in data.items() if k in names})
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed {kind.__name__}: {type(e).__name__}: {e}") from e
