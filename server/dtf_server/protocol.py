"""The host protocol: each launcher command's request and reply, typed once for both sides.

The client runs a command as `PYTHON LAUNCHER *request.args()`, from a frozen dataclass per
command (`CheckRequest`, `StartRequest`, ...); the launcher reads the same request back with
`parse()`, its parser built from the same fields. The launcher (this package, on a host) prints
exactly one JSON document per command: the reply's fields and `"protocol": PROTOCOL`. The client
(`dtf.hostops.launcher`) decodes it with `decode()` into the same frozen dataclasses, so neither
side reads raw keys or writes an option by hand.
A reply of another protocol version is refused (`ProtocolMismatch`), never half-read: the client
then ships its own launcher and asks again.

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import signal
import sys
from collections.abc import Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any, ClassVar, NoReturn, TypeVar

# Bump on any change of a command's arguments or of a reply's fields: a reply of another version
# is refused, never half-read (what each version changed: this file's git log).
PROTOCOL = 16

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
    RUN_STEP_WAIT = 60.0  # seconds a Slurm job step of program copies gets to start them (srun, imports)
    RELAY_WAIT = 30.0  # seconds a `sync` relay waits for its children to connect, then starts without the others
    RELAY_STALL = 120.0  # seconds a host-to-host stream may make no progress before it is given up


class Layout:
    """Where dtf's files live on a host: the plan (client) and the launcher (host) both use this.

    Everything of one cluster lives below its root, WORKDIR/CLUSTER:

        ROOT/launcher-<hash>.pyz   the launcher (dtf_server, one zipapp named by its content)
        ROOT/dtf-<hash>.zip        dtf's own package (collective mode's copies import it)
        ROOT/lease.json            {ttl, renewed}: see supervisor.py
        ROOT/.expire-lock          taken by tasks removing their files when the lease lapsed
        ROOT/firewall.json         the TF ports' firewall rules its start set (`firewall: auto`, `members`: firewall.py)
        ROOT/authorized.json       the coordinator host's key this host lets in (`dtf train --detach`: detached.py)
        ROOT/detached/             a detached run, on the host it runs on (DetachedLayout)
        ROOT/top-<pid>.json        a running `top` stream (its pid and start time): `clean` ends it
        ROOT/JOB-INDEX/            one per task:
            log                    the supervisor's and the server's output
            pid.json               the supervisor's pid and process start time (and its task)
            supervisor.json        restarts, last exit, the server's pid
            ready.json             written by the server once it serves
            crash                  (fake servers only) makes the fake server exit: for tests
            train.json             collective mode: the program copy's training figures (`top` reads them)
            out/                   collective mode: the program copy's working and output directory
        ROOT/chief-0/              a detached run's coordinator (`dtf train --detach`), supervised as a task

    What outlives a cluster (kept by `dtf down` as a cache, removed by `dtf down --purge`) lives
    beside the clusters, below WORKDIR/.cache (a cluster name cannot start with a dot):

        WORKDIR/.cache/env/<hash>/   a managed Python environment, named by a hash of its contents;
                                     complete once its ENV_MARKER exists (written last)
        WORKDIR/.cache/wheels/       the wheels dtf sent to build those (a flat directory)
        WORKDIR/.cache/bin/uv-<hash> the uv binary that builds them
        WORKDIR/.cache/sync/<hash>/  a tree sent by `dtf sync`, named by a hash of its contents

    Paths are posix paths as the plan writes them (a leading ~/ is the host user's home).
    """

    LAUNCHER_PREFIX = "launcher-"
    LAUNCHER_SUFFIX = ".pyz"
    OLD_LAUNCHER = "launcher.py"  # what dtf before the protocol version uploaded
    HELPERS_PREFIX, HELPERS_SUFFIX = "dtf-", ".zip"
    HELPERS_ENV = "DTF_HELPERS"  # the zip's path, in a collective `run`'s environment (its copies' PYTHONPATH)
    LEASE = "lease.json"
    EXPIRE_LOCK = ".expire-lock"
    FIREWALL = "firewall.json"
    TOP_PREFIX = "top-"  # + pid + ".json": a running `top` stream's record (maintenance.cmd_top)
    LOG = "log"
    PID = "pid.json"
    SUPERVISOR = "supervisor.json"
    READY = "ready.json"
    CRASH = "crash"
    TRAIN = "train.json"  # the name dtf.program.figures writes
    OUT = "out"  # a program copy's working and output directory, below its task directory
    CACHE = ".cache"
    ENV_MARKER = ".dtf-env.json"  # in a managed environment: written last, once it is complete
    DETACHED = "detached"  # a detached run's files (`dtf train --detach`: DetachedLayout), below ROOT
    CHIEF = "chief:0"  # a detached run's coordinator, supervised as a task of its host (ROOT/chief-0)
    AUTHORIZED = "authorized.json"  # the key line `authorize` added to ~/.ssh/authorized_keys (detached.py)

    @staticmethod
    def cache_dir(workdir: str, kind: str = "") -> str:
        """WORKDIR/.cache, or WORKDIR/.cache/KIND ("env", "sync")."""
        return posixpath.join(workdir, Layout.CACHE, kind) if kind else posixpath.join(workdir, Layout.CACHE)

    @staticmethod
    def synced_from_task(digest: str, subpath: str = "") -> str:
        """A synced tree (or the file in it) as a path relative to a task's directory: every server
        runs there (WORKDIR/CLUSTER/JOB-INDEX), so this one path is right on every host, whatever
        its WORKDIR or home directory."""
        return posixpath.join("..", "..", Layout.CACHE, "sync", digest, *filter(None, [subpath]))

    @staticmethod
    def launcher_name(digest: str) -> str:
        return f"{Layout.LAUNCHER_PREFIX}{digest}{Layout.LAUNCHER_SUFFIX}"

    @staticmethod
    def helpers_name(digest: str) -> str:
        """dtf's own package, zipped (collective mode's copies import it), beside the launcher."""
        return f"{Layout.HELPERS_PREFIX}{digest}{Layout.HELPERS_SUFFIX}"

    @staticmethod
    def is_helpers(filename: str) -> bool:
        return filename.startswith(Layout.HELPERS_PREFIX) and filename.endswith(Layout.HELPERS_SUFFIX)

    @staticmethod
    def is_launcher(filename: str) -> bool:
        return filename == Layout.OLD_LAUNCHER or (filename.startswith(Layout.LAUNCHER_PREFIX)
                                                   and filename.endswith(Layout.LAUNCHER_SUFFIX))

    @staticmethod
    def task_dir(root: str, job: str, index: int) -> str:
        return posixpath.join(root, f"{job}-{index}")

    @staticmethod
    def in_task(root: str, job: str, index: int, filename: str) -> str:
        return posixpath.join(Layout.task_dir(root, job, index), filename)

    @staticmethod
    def parse_name(text: str) -> tuple[str, int]:
        """A task's name, JOB:INDEX, as its job and index."""
        job, index = text.split(":")
        return job, int(index)


class DetachedLayout:
    """A detached run's files (`dtf train --detach`), below ROOT/detached on the host it runs on:

        spec.json      what the laptop asked: the program, its arguments, its options, the record
        output.log     all the run printed, its coordinator's lines and the program's (`dtf attach`)
        home/          the coordinator's DTF_HOME: the cluster's record as seen from this host
        work/          the program's working directory: the laptop's, its program's folder in place
        output/        --output, where it is not below the laptop's working directory
        shipped.json   work/'s files as shipped, path -> [size, mtime in ns]: the others come back
        back/          what comes back to the laptop (`detached --collect`): work/ and output/
        ssh/           the cluster key, with the ssh_config and known_hosts that reach the others
        ended.json     how the run ended: {exit_code, reason, time}, written by its coordinator

    Its coordinator is a task of the host (Layout.CHIEF): its supervisor says how it ended where it
    could not (killed). The lease's end keeps this directory while it holds a run (its outputs are
    the user's until fetched: `dtf attach`, `dtf down`), and removes the rest of the cluster's.
    """

    SPEC = "spec.json"
    OUTPUT_LOG = "output.log"
    HOME = "home"
    WORK = "work"
    OUTPUT = "output"
    SHIPPED = "shipped.json"
    BACK = "back"
    SSH = "ssh"
    ENDED = "ended.json"

    @staticmethod
    def dir(root: str) -> str:
        return posixpath.join(root, Layout.DETACHED)

    @staticmethod
    def path(root: str, *parts: str) -> str:
        return posixpath.join(root, Layout.DETACHED, *parts)


class ProtocolMismatch(Exception):
    """A reply from a launcher that speaks another protocol version."""

    def __init__(self, found: object) -> None:
        super().__init__(f"the launcher there speaks protocol {found!r}, this dtf speaks {PROTOCOL}")
        self.found = found


# -- what both sides say and read the same way ------------------------------------------------
def exit_reason(code: int) -> str:
    """What a Popen returncode means, in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# Where dtf.program.runner writes the exit code the program ended with, once Python has run its atexit
# functions: TensorFlow's runtime can still crash after that (SIGABRT, "terminate called after
# throwing ...", seen after a worker was lost and came back), with the program's work all done.
EXIT_STATUS_ENV = "DTF_EXIT_STATUS_FILE"


def ended_before_crash(code: int, status_path: str) -> int | None:
    """The program's own exit code when it ended (dtf.program.runner wrote it to `status_path`) and then
    died of a signal (`code` < 0) while Python shut down; None otherwise."""
    if code >= 0:
        return None
    try:
        with open(status_path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


TF_DISTRIBUTIONS = ("tensorflow", "tensorflow_cpu")  # as dist-info directories spell them


def tf_version() -> str | None:
    """The TensorFlow version of this python, from package metadata (any build: tensorflow,
    tensorflow-cpu); importing TensorFlow would take seconds. The check's `tensorflow` on a host,
    and what the laptop compares it with.

    First from the names of the `NAME-VERSION.dist-info` directories on sys.path, as
    importlib.metadata finds them (the first name, then the first path entry that has it): what
    pip, uv and conda install. importlib.metadata itself (eggs, zips) only where that finds none:
    its import (email, zipfile, csv) would be most of the check's own work."""
    listings: dict[str, list[str]] = {}
    for name in TF_DISTRIBUTIONS:
        for entry in sys.path:
            if entry not in listings:
                try:
                    listings[entry] = os.listdir(entry or ".")
                except OSError:
                    listings[entry] = []
            for item in listings[entry]:
                stem, _, suffix = item.rpartition(".")
                dist, dash, version = stem.partition("-")
                if (suffix == "dist-info" and dash and version
                        and dist.lower().replace(".", "_") == name):
                    return version
    from importlib import metadata

    for name in TF_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# `follow`'s stream (dtf_server.program.follow): on stderr, besides the copy's output, these lines.
BEAT_EVENT = "dtf-beat"  # every --beat seconds: the host is there
JOINED_EVENT = "dtf-joined"  # the copy's strategy has joined the others
EXIT_EVENT = "dtf-exit "  # + {"code": ..., "reason": ...}: the copy has ended
OFFSET_EVENT = "dtf-offset "  # + N: `follow --file` streams the file from byte N on


# -- what a request carries ----------------------------------------------------------------------
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


# -- requests: each command's command line, typed ---------------------------------------------
# The client builds a request and runs `PYTHON LAUNCHER *request.args()`; the launcher reads the
# same request back (`parse`, with a parser built from the same fields). A field's metadata says
# how it is written (`option`, `flag`, `many`, `group`): `--` and its name with dashes, unless
# named otherwise.

class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # an option without a default: the command line must give it


@dataclass(frozen=True)
class Option:
    """How one field of a request is written on the command line."""

    kind: type  # str, int, float, TaskSpec (as JSON), or bool (a flag: given or not)
    name: str = ""  # "--name" ("": the field's name, with dashes)
    many: bool = False  # given once per value, in order: a list
    default: Any = REQUIRED  # what the launcher takes when it is not given
    path: bool = False  # a path on the host: the launcher expands a leading ~/, as a shell would
    choices: tuple[str, ...] = ()


def option(kind: type = str, *, default: Any = REQUIRED, always: bool = False, name: str = "",
           path: bool = False, choices: tuple[str, ...] = ()) -> Any:
    """A field given once (`--name VALUE`). Its `default` is the request's too, and args() leaves
    a value equal to it out (the launcher takes it anyway); `always`: the client gives it every
    time (the request has no default, the launcher has)."""
    meta = {"option": Option(kind, name, default=default, path=path, choices=choices)}
    return field(metadata=meta) if default is REQUIRED or always else field(default=default, metadata=meta)


def flag(name: str = "") -> Any:
    """A bool field: `--name` given, or not."""
    return field(default=False, metadata={"option": Option(bool, name, default=False)})


def many(kind: type = str, name: str = "") -> Any:
    """A list field: `--name` given once per value (none: an empty list)."""
    return field(default_factory=list, metadata={"option": Option(kind, name, many=True, default=[])})


def group(kind: type[Options]) -> Any:
    """A field that is options of its own (an Options dataclass), written in its place."""
    return field(default_factory=kind, metadata={"group": kind})


def _name(f: Field[Any]) -> str:
    return f.metadata["option"].name or "--" + f.name.replace("_", "-")


def _text(value: object) -> str:
    """A value as its option says it: a float as short as it stays exact (90, 0.5)."""
    if isinstance(value, TaskSpec):
        return value.to_arg()
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


class Options:
    """A frozen, keyword-only dataclass whose fields are a launcher command's options (this base
    has none: not a dataclass itself)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # (a subclass's, as dataclasses.fields reads them)

    def args(self) -> list[str]:
        """The options, in the fields' order: a flag when true, a list's every value, a value
        unless it is the default (a field with no default always)."""
        said: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if "group" in f.metadata:
                said += value.args()
                continue
            o: Option = f.metadata["option"]
            if o.kind is bool:
                said += [_name(f)] if value else []
            elif o.many:
                said += [a for v in value for a in (_name(f), _text(v))]
            elif value is not None and (f.default is MISSING or value != f.default):
                said += [_name(f), _text(value)]
        return said

    @classmethod
    def kind_of(cls, name: str) -> type:
        """What field `name`'s option holds: str, int, float, TaskSpec or bool."""
        kind: type = next(f.metadata["option"].kind for f in fields(cls) if f.name == name)
        return kind


OptionsT = TypeVar("OptionsT", bound=Options)


class Request(Options):
    """One launcher command's command line: `args()` is what follows `PYTHON LAUNCHER`."""

    command: ClassVar[str] = ""

    def args(self) -> list[str]:
        return [self.command, *super().args()]


@dataclass(frozen=True, kw_only=True)
class CheckRequest(Request):
    """versions, busy ports, the SSH client's address, the platform; with --env: is that managed
    environment complete (dtf_server.envs)"""

    command = "check"
    dir: str | None = option(default=None, path=True)
    port: list[int] = many(int)
    env: str | None = option(default=None, path=True)
    wheels: str | None = option(default=None, path=True)


@dataclass(frozen=True, kw_only=True)
class EnvRequest(Request):
    """build managed environment --env from the sent wheels with uv (dtf_server.envs)"""

    command = "env"
    env: str = option(path=True)
    wheels: str = option(path=True)
    uv: str = option(path=True)
    requirements: str = option(path=True)


@dataclass(frozen=True, kw_only=True)
class PurgeRequest(Request):
    """remove WORKDIR/.cache (environments, wheels, synced trees)"""

    command = "purge"
    workdir: str = option(path=True)


@dataclass(frozen=True, kw_only=True)
class ServeWheelsRequest(Request):
    """serve those wheels to the other hosts, until no request comes for --idle seconds"""

    command = "serve-wheels"
    dir: str = option(path=True)
    port: int = option(int)
    idle: float = option(float, default=15.0, always=True)
    limit: float = option(float, default=900.0, always=True)
    file: list[str] = many()


@dataclass(frozen=True, kw_only=True)
class FetchWheelsRequest(Request):
    """copy wheels (NAME:SHA256) from another host's serve-wheels"""

    command = "fetch-wheels"
    source: str = option(name="--from")
    dir: str = option(path=True)
    file: list[str] = many()
    wait: float = option(float, default=30.0)
    timeout: float = option(float, default=30.0)


@dataclass(frozen=True, kw_only=True)
class Firewall(Options):
    """A start's firewall rules on the TF ports (dtf_server.firewall), set before any server starts:
    closed to all but `allow`, loopback, the SSH client (`client`: the laptop, as the host sees
    it) and a Slurm step's srun host (`launch_node`)."""

    mode: str = option(default="off", name="--firewall", choices=("off", "auto", "members"))
    ports: list[int] = many(int, name="--firewall-port")  # every task port of the host (a repair starts only some)
    allow: list[str] = many()
    client: bool = flag("--allow-client")
    launch_node: bool = flag("--allow-launch-node")


@dataclass(frozen=True, kw_only=True)
class StartRequest(Request):
    """start supervised servers detached (a supervisor forked per task restarts its server when it
    dies), wait until each serves; --keep (a Slurm job step): then stay until they have ended"""

    command = "start"
    dir: str = option(path=True)
    timeout: float = option(float, default=Defaults.START_TIMEOUT, always=True)
    ttl: float = option(float, default=Defaults.TTL, always=True)
    restart_limit: int = option(int, default=Defaults.RESTART_LIMIT, always=True)
    restart_backoff: float = option(float, default=Defaults.RESTART_BACKOFF, always=True)
    env: list[str] = many()  # NAME=VALUE
    keep: bool = flag()  # a Slurm node's job step: after the reply, stay until the supervisors forked here end
    firewall: Firewall = group(Firewall)
    # `up`'s mesh check in the same call: once these servers serve, the other hosts' tasks
    # (ADDR:PORT); once told on stdin, waiting that long for it (see start.cmd_start).
    reach: list[str] = many()
    reach_when_told: float = option(float, default=0.0)
    reach_timeout: float = option(float, default=5.0)
    task: list[TaskSpec] = many(TaskSpec)


@dataclass(frozen=True, kw_only=True)
class CheckStartRequest(StartRequest):
    """check, then start if the host passes: its TensorFlow is --tensorflow ("": not compared), the
    ports are free, with --fresh no task of this cluster runs there, it has the --gpus it is given"""

    command = "check-start"
    port: list[int] = many(int)
    tensorflow: str = option(default="")
    fresh: bool = flag()
    gpus: int = option(int, default=0)  # GPUs the tasks are given (their highest id + 1)


@dataclass(frozen=True, kw_only=True)
class ServerRequest(Request):
    """What serves one task (the plan's serve command, which its supervisor runs)."""

    job: str = option()
    index: int = option(int)
    port: int = option(int)
    ready: str = option(path=True)  # written once it serves


@dataclass(frozen=True, kw_only=True)
class ServeRequest(ServerRequest):
    """(internal) run one tf.distribute.Server"""

    command = "serve"
    full: bool = flag()  # `import tensorflow`, not only its server module: see dtf_server.tfserve


@dataclass(frozen=True, kw_only=True)
class FakeRequest(ServerRequest):
    """(tests) a server without TensorFlow (dtf_server.fake)"""

    command = "fake"
    ready_delay: float = option(float, default=0.0)
    ignore_term: bool = flag()
    ready_file: str | None = option(default=None)


@dataclass(frozen=True, kw_only=True)
class RunRequest(Request):
    """collective mode: start one supervised program copy per task"""

    command = "run"
    dir: str = option(path=True)
    env: list[str] = many()  # NAME=VALUE
    clear_output: bool = flag()
    spawned: str = option(default="")  # Slurm: `run-step` started the copies with this token
    task: list[TaskSpec] = many(TaskSpec)


@dataclass(frozen=True, kw_only=True)
class RunStepRequest(Request):
    """collective mode on Slurm: one task of the job step that runs every copy"""

    command = "run-step"
    dir: str = option(path=True)
    env: list[str] = many()
    clear_output: bool = flag()
    token: str = option()
    task: list[TaskSpec] = many(TaskSpec)  # in worker order
    host: list[str] = many()  # the node each copy is planned on


@dataclass(frozen=True, kw_only=True)
class SuperviseProgramRequest(Request):
    """(internal) run one program copy once (dtf_server.program)"""

    command = "supervise-program"
    dir: str = option(path=True)
    task: TaskSpec = option(TaskSpec)


@dataclass(frozen=True, kw_only=True)
class FollowRequest(Request):
    """stream a program copy's output and events until it ends; --file: that file below --dir
    (from --offset, or its last --lines lines) instead of the task's log from the run's start"""

    command = "follow"
    dir: str = option(path=True)
    task: str = option()  # JOB:INDEX
    beat: float = option(float, default=2.0, always=True)
    file: str = option(default="")
    offset: int = option(int, default=-1)
    lines: int = option(int, default=-1)


@dataclass(frozen=True, kw_only=True)
class AuthorizeRequest(Request):
    """let a detached run's coordinator host in: add --key to this user's ~/.ssh/authorized_keys,
    only from --allow addresses, until the lease lapses (--ttl where this host has no lease yet;
    clean and the lease remove it); say the login, and the host keys this host's sshd shows (at the
    address and port of this SSH session)"""

    command = "authorize"
    dir: str = option(path=True)
    key: str = option()
    allow: list[str] = many()
    ttl: float = option(float, default=Defaults.TTL)


@dataclass(frozen=True, kw_only=True)
class DetachedRequest(Request):
    """a detached run on this host: running or ended (its exit code), its figures; --collect: and
    what it wrote, gathered for the laptop to fetch; --fresh: an ended run's files removed first"""

    command = "detached"
    dir: str = option(path=True)
    collect: bool = flag()
    fresh: bool = flag()


@dataclass(frozen=True, kw_only=True)
class TopRequest(Request):
    """one TopSample line per --interval (status, CPU, memory, network per task) until its reader
    goes, or for --for seconds; --states-only: the states alone"""

    command = "top"
    dir: str = option(path=True)
    interval: float = option(float, default=1.0, always=True)
    for_seconds: float = option(float, default=24 * 3600.0, name="--for")
    states_only: bool = flag()
    task: list[str] = many()  # JOB:INDEX


@dataclass(frozen=True, kw_only=True)
class LogRequest(Request):
    """a task's last --lines lines, without TensorFlow's own unless --all (dtf_server.tflog);
    --follow: then new lines as they come, until the reader or the task goes"""

    command = "log"
    dir: str = option(path=True)
    task: str = option()  # JOB:INDEX
    lines: int = option(int, default=100, always=True)
    follow: bool = flag()
    all: bool = flag()


@dataclass(frozen=True, kw_only=True)
class RenewRequest(Request):
    """renew the cluster's lease on this host (--ttl: a new one)"""

    command = "renew"
    dir: str = option(path=True)
    ttl: float | None = option(float, default=None)


@dataclass(frozen=True, kw_only=True)
class StatusRequest(Request):
    """is each task alive, serving, restarted how often; --renew: and renew the lease"""

    command = "status"
    dir: str = option(path=True)
    renew: bool = flag()
    task: list[str] = many()  # JOB:INDEX


@dataclass(frozen=True, kw_only=True)
class StopRequest(Request):
    """TERM each task's process group, KILL after --grace seconds; --clean: then clean, once every
    task is gone (`down` in one call)"""

    command = "stop"
    dir: str = option(path=True)
    grace: float = option(float, default=Defaults.STOP_GRACE, always=True)
    task: list[str] = many()  # JOB:INDEX
    clean: bool = flag()
    keep_logs: bool = flag()


@dataclass(frozen=True, kw_only=True)
class CleanRequest(Request):
    """remove what dtf put in --dir (firewall rules too); --if-unused: not where tasks live"""

    command = "clean"
    dir: str = option(path=True)
    keep_logs: bool = flag()
    if_unused: bool = flag()


@dataclass(frozen=True, kw_only=True)
class ReachRequest(Request):
    """which targets (ADDR:PORT) this host cannot connect to; renews --dir's lease"""

    command = "reach"
    dir: str | None = option(default=None, path=True)
    timeout: float = option(float, default=3.0, always=True)
    to: list[str] = many()


@dataclass(frozen=True, kw_only=True)
class SyncRequest(Request):
    """whether --dir/--hash exists (--free-port: and a port free here); --receive: make it from the
    pack on stdin, or from another host (--from ADDR:PORT), passing it on to --children hosts
    from port --serve (dtf_server.receive)"""

    command = "sync"
    dir: str = option(path=True)
    hash: str = option()
    receive: bool = flag()
    free_port: bool = flag()
    source: str | None = option(default=None, name="--from")
    serve: int = option(int, default=0)
    children: int = option(int, default=0)
    token: str = option(default="")
    wait: float | None = option(float, default=None)  # for the parent and the children (None: Defaults.RELAY_WAIT)


# Every command, in the order the launcher's help lists them.
REQUESTS: tuple[type[Request], ...] = (
    CheckRequest, CheckStartRequest, StartRequest, ServeRequest, FakeRequest, StatusRequest, TopRequest, LogRequest,
    RenewRequest, StopRequest, CleanRequest, ReachRequest, SyncRequest, EnvRequest, PurgeRequest, ServeWheelsRequest,
    FetchWheelsRequest, RunRequest, RunStepRequest, SuperviseProgramRequest, FollowRequest, AuthorizeRequest,
    DetachedRequest)


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a usage error exits EXIT_USAGE with one line on stderr (2 means
    "no launcher there": see EXIT_NO_LAUNCHER), and options are never abbreviated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parser(command: str | None = None) -> Parser:
    """The launcher's parser, every command's options read from its request's fields; `command`:
    that command's alone (a command line needs no other: building them all is most of a parse)."""
    p = Parser(prog="launcher", description="dtf's launcher: one command per call, one JSON reply "
                                            "(dtf_server.protocol).")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for kind in REQUESTS:
        if command is not None and kind.command != command:
            continue
        doc = " ".join((kind.__doc__ or "").split())
        c = commands.add_parser(kind.command, help=doc, description=doc)
        c.set_defaults(request=kind, parser=c)
        _add_options(c, kind, "")
    return p


def _add_options(c: argparse.ArgumentParser, kind: type[Options], prefix: str) -> None:
    for f in fields(kind):
        if "group" in f.metadata:
            _add_options(c, f.metadata["group"], f"{prefix}{f.name}.")
            continue
        o: Option = f.metadata["option"]
        name, dest = _name(f), prefix + f.name
        metavar = name[2:].upper().replace("-", "_")
        if o.kind is bool:
            c.add_argument(name, dest=dest, action="store_true")
            continue
        convert = _spec if o.kind is TaskSpec else o.kind
        if o.many:
            c.add_argument(name, dest=dest, action="append", default=[], type=convert, metavar=metavar)
        else:
            c.add_argument(name, dest=dest, type=convert, metavar=metavar, required=o.default is REQUIRED,
                           default=None if o.default is REQUIRED else o.default, choices=o.choices or None)


def _spec(text: str) -> TaskSpec:
    try:
        return TaskSpec.from_arg(text)
    except (KeyError, TypeError, ValueError) as e:  # (argparse says which option, and the value)
        raise argparse.ArgumentTypeError(f"not a task spec ({type(e).__name__}: {e}): {text[:200]}") from e


def parse(argv: Sequence[str]) -> Request:
    """The request a launcher command line says (args() read back), a leading ~/ of its paths
    expanded. A usage error (an unknown command or option, a missing or bad value) exits
    EXIT_USAGE with one line on stderr."""
    argv = list(argv)
    known = argv[0] if argv and any(argv[0] == kind.command for kind in REQUESTS) else None
    namespace, extra = parser(known).parse_known_args(argv)
    if extra:  # said by the command's parser, which names the command
        namespace.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    request: Request = _read(namespace.request, namespace, "")
    return request


def _read(kind: type[OptionsT], namespace: argparse.Namespace, prefix: str) -> OptionsT:
    values: dict[str, Any] = {}
    for f in fields(kind):
        if "group" in f.metadata:
            values[f.name] = _read(f.metadata["group"], namespace, f"{prefix}{f.name}.")
            continue
        value = getattr(namespace, prefix + f.name)
        if f.metadata["option"].path and isinstance(value, str):
            value = os.path.expanduser(value)
        values[f.name] = value
    return kind(**values)


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
    # `start --firewall`: the TF ports' firewall rules it set first, or why it could not (None: not asked)
    firewall: FirewallReply | None = None
    refused: str | None = None  # why it started nothing (`--firewall members` where rules cannot be set)

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
class FirewallReply:
    """`firewall`: the TF ports' firewall rules on this host (set, or removed)."""

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
class AuthorizeReply:
    """`authorize`: the login the key lets in, and what the coordinator host needs to trust this
    host's sshd (the keys it shows, scanned here; none where this host has no ssh-keyscan)."""

    user: str
    host_keys: list[str]  # "TYPE BASE64" each
    port: int | None = None  # the port this session came in at (SSH_CONNECTION): where sshd listens
    error: str | None = None  # why the key could not be added


@dataclass(frozen=True)
class DetachedReply:
    """`detached`: the detached run on this host. `state`: "running", "ended", or "none" (no run
    here); `run`: its coordinator's figures (dtf.program.figures' run.json, train.json under
    "train"); `placement`: host -> its tasks, as the coordinator's record holds them (tasks moved
    to a spare); `collected`: with --collect, the files gathered for the laptop (DetachedLayout.BACK)."""

    state: str
    run_id: str = ""
    exit_code: int | None = None
    reason: str = ""
    started: float | None = None
    ended: float | None = None
    size: int = 0  # bytes of its output so far
    run: dict[str, Any] | None = None
    placement: dict[str, list[str]] | None = None
    retired: list[str] = field(default_factory=list)
    recovered: dict[str, str] = field(default_factory=dict)
    collected: int | None = None


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


Reply = (CheckReply | StartReply | StatusReply | RenewReply | StopReply | CleanReply | ReachReply | FirewallReply
         | SyncReply | EnvReply | PurgeReply | ServeReply | FetchReply | TopSample | AuthorizeReply | DetachedReply)
R = TypeVar("R", CheckReply, StartReply, StatusReply, RenewReply, StopReply, CleanReply, ReachReply,
                FirewallReply, SyncReply, EnvReply, PurgeReply, ServeReply, FetchReply, TopSample, AuthorizeReply,
                DetachedReply)


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
            rules = data.get("firewall")
            return StartReply(tasks={n: TaskStarted(**t) for n, t in data["tasks"].items()},  # type: ignore[return-value]
                              unreachable=data.get("unreachable"),
                              firewall=FirewallReply(**rules) if rules is not None else None,
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
