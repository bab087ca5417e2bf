"""The local record of clusters: `$DTF_HOME/state/NAME.json` (DTF_HOME defaults to ~/.dtf).

A record (`Record`) holds the plan, the pid of every task, and the laptop's address as the hosts
saw it; it carries a format version, so a record written by another dtf is named as such instead
of being misread. Every command that changes records holds `$DTF_HOME/lock` (flock), so two dtf
commands cannot corrupt a record; a second one waits a little, then fails with a clear message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtf.errors import NoCluster, StateBusy

if TYPE_CHECKING:  # the plan and the synced trees: `dtf --help` needs neither
    from dtf.cluster.plan import Plan
    from dtf.files.sync import Synced

LOCK_WAIT = 5.0
# The format of a record. Records before this field existed are version 1; a record of another
# version is refused with one line (what to do about it), never half-read. Version 2 (its plan's
# allocation under the key "slurm") is read as this one.
RECORD_VERSION = 3
READS = (2, RECORD_VERSION)


@dataclass(frozen=True)
class DetachedRun:
    """A detached run (`dtf train --detach`: dtf.detached) as this machine knows it."""

    run_id: str
    host: str  # the host its coordinator runs on
    program: str  # as the user gave it (for the lines that name the run)
    started: float  # time.time() here when `dtf train --detach` started it
    cwd: str  # this machine's working directory then: what the program writes there comes back there
    output: str | None = None  # --output (absolute), where it is not below `cwd` (it comes back there)
    ended: bool = False  # seen ended (by `attach`, `status` or `down`)
    exit_code: int | None = None
    reason: str = ""  # how it ended, in a few words ("exited with code 0", "killed by SIGKILL")
    fetched: bool = False  # its outputs were brought back here

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DetachedRun:
        return cls(run_id=str(data["run_id"]), host=str(data["host"]), program=str(data["program"]),
                   started=float(data["started"]), cwd=str(data["cwd"]), output=data.get("output"),
                   ended=bool(data.get("ended", False)), exit_code=data.get("exit_code"),
                   reason=str(data.get("reason", "")), fetched=bool(data.get("fetched", False)))

    def replace(self, **changes: Any) -> DetachedRun:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Record:
    """What dtf remembers of a cluster it started."""

    plan: Plan
    inventory: str  # the inventory file it was started from (absolute)
    created: float  # time.time() when `dtf up` started it
    chief_host: str  # the laptop's address as the hosts see it (the coordinator's TF address)
    pids: dict[str, int] = field(default_factory=dict)  # task name -> its supervisor's pid
    taking_down: bool = False  # `dtf down` has begun: a running `dtf train` stops its program
    network: str = "direct"  # how this machine reaches the tasks: "direct", or "ssh" (dtf.hosts.tunnel)
    tf_ports_open: bool = True  # the TF ports accepted connections from this machine directly
    synced: dict[str, Synced] = field(default_factory=dict)  # name -> what every host holds (dtf sync)
    # Slurm: which allocation of the cluster its job is (1: `up`'s; more: `dtf train` replaced an
    # ended job, dtf.providers.slurm.reallocate), and the jobs it replaced, each "JOB: why it ended".
    allocation: int = 1
    replaced: list[str] = field(default_factory=list)
    # task name -> what dtf did to bring it back (restarted, moved to a spare): `status`, `top`
    recovered: dict[str, str] = field(default_factory=dict)
    # `dtf train --detach`: the run whose coordinator runs on a host of the cluster (dtf.detached)
    detached: DetachedRun | None = None
    # The host this record's coordinator runs on, where it is a detached run's (dtf.detached.vantage:
    # the cluster as that host sees it); None: this machine's record.
    coordinator: str | None = None

    @property
    def cluster(self) -> str:
        return self.plan.cluster

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "cluster": self.cluster, "inventory": self.inventory,
                "created": self.created, "chief_host": self.chief_host, "pids": dict(self.pids),
                "taking_down": self.taking_down, "network": self.network,
                "tf_ports_open": self.tf_ports_open, "plan": self.plan.to_dict(),
                "synced": {name: s.to_dict() for name, s in self.synced.items()},
                "allocation": self.allocation, "replaced": list(self.replaced),
                "recovered": dict(self.recovered),
                "detached": self.detached.to_dict() if self.detached is not None else None,
                "coordinator": self.coordinator}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        from dtf.cluster.plan import Plan
        from dtf.files.sync import Synced

        detached = data.get("detached")
        return cls(plan=Plan.from_dict(data["plan"]), inventory=data["inventory"],
                   created=data["created"], chief_host=data["chief_host"],
                   pids={str(k): int(v) for k, v in data["pids"].items()},
                   taking_down=bool(data.get("taking_down", False)),
                   network=str(data.get("network", "direct")),
                   tf_ports_open=bool(data.get("tf_ports_open", True)),
                   synced={str(k): Synced.from_dict(v) for k, v in data.get("synced", {}).items()},
                   allocation=int(data.get("allocation", 1)), replaced=[str(x) for x in data.get("replaced", [])],
                   recovered={str(k): str(v) for k, v in data.get("recovered", {}).items()},
                   detached=DetachedRun.from_dict(detached) if detached else None,
                   coordinator=data.get("coordinator"))

    def replace(self, **changes: Any) -> Record:
        return dataclasses.replace(self, **changes)


def home() -> Path:
    return Path(os.environ.get("DTF_HOME") or "~/.dtf").expanduser()


def state_dir() -> Path:
    return home() / "state"


@contextlib.contextmanager
def locked(wait: float = LOCK_WAIT) -> Iterator[None]:
    """Hold dtf's state lock; fail with StateBusy if another dtf holds it for `wait` seconds."""
    home().mkdir(parents=True, exist_ok=True)
    path = home() / "lock"
    with open(path, "a+") as f:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise StateBusy(f"another dtf command is running (pid {holder}); "
                                    f"try again when it is done (lock: {path})")
                time.sleep(0.1)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def names() -> list[str]:
    d = state_dir()
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def resolve_name(name: str | None) -> str:
    """The cluster a command acts on: the one named, or the only one recorded."""
    recorded = names()
    if name:
        if name not in recorded:
            have = f" (recorded: {', '.join(recorded)})" if recorded else ""
            raise NoCluster(f"no cluster named {name!r} is up{have}; run `dtf up INVENTORY` first")
        return name
    if not recorded:
        raise NoCluster("no cluster is up: run `dtf up INVENTORY` first")
    if len(recorded) > 1:
        raise NoCluster(f"several clusters are up ({', '.join(recorded)}): pass --cluster NAME")
    return recorded[0]


def path_of(name: str) -> Path:
    return state_dir() / f"{name}.json"


def load(name: str) -> Record:
    path = path_of(name)

    def damaged(why: str) -> NoCluster:
        return NoCluster(f"the record of cluster {name!r} is damaged ({path}: {why}); "
                         f"remove it after checking its hosts by hand")

    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoCluster(f"no cluster named {name!r} is up; run `dtf up INVENTORY` first")
    except ValueError as e:
        raise damaged(str(e))
    if not isinstance(data, dict):
        raise damaged(f"expected a JSON object, got {type(data).__name__}")
    version = data.get("version", 1)
    if version == 2 and isinstance(data.get("plan"), dict) and "slurm" in data["plan"]:
        data["plan"]["allocation"] = data["plan"].pop("slurm")
    if version not in READS:
        raise NoCluster(f"the record of cluster {name!r} ({path}) was written by another version of "
                        f"dtf (record format {version}, this dtf reads {RECORD_VERSION}): take the "
                        f"cluster down with the dtf that started it, or stop its tasks by hand and "
                        f"remove the record")
    try:
        return Record.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise damaged(f"{type(e).__name__}: {e}")


def save(record: Record) -> None:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = path_of(record.cluster)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record.to_dict(), separators=(",", ":")))  # (no indent: json's C encoder)
    os.replace(tmp, path)  # atomic: `dtf train` reads it while it runs


def remove(name: str) -> None:
    path_of(name).unlink(missing_ok=True)
