"""The local record of clusters: `$DTF_HOME/state/NAME.json` (DTF_HOME defaults to ~/.dtf).

A record holds the plan, the pid of every task, and the laptop's address as the hosts saw it.
Every command that reads or writes records holds `$DTF_HOME/lock` (flock), so two dtf commands
cannot corrupt a record; a second one waits a little, then fails with a clear message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from dtf.errors import NoCluster, StateBusy

LOCK_WAIT = 5.0


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


def load(name: str) -> dict:
    path = state_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise NoCluster(f"no cluster named {name!r} is up; run `dtf up INVENTORY` first")
    except ValueError as e:
        raise NoCluster(f"the record of cluster {name!r} is damaged ({path}: {e}); "
                        f"remove it after checking its hosts by hand")


def save(name: str, record: dict) -> None:
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def remove(name: str) -> None:
    (state_dir() / f"{name}.json").unlink(missing_ok=True)
