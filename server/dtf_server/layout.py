"""Where dtf's files live on a host. The plan (client) and the launcher (host) both use this.

Everything of one cluster lives below its root, WORKDIR/CLUSTER:

    ROOT/launcher-<hash>.pyz   the launcher (this package, one zipapp named by its content)
    ROOT/lease.json            {ttl, renewed}: see supervisor.py
    ROOT/.expire-lock          taken by tasks removing their files when the lease lapsed
    ROOT/fence.json            the TF ports' firewall rules its start set (`firewall: auto`, `members`: fence.py)
    ROOT/top-<pid>.json        a running `top` stream (its pid and start time): `clean` ends it
    ROOT/JOB-INDEX/            one per task:
        log                    the supervisor's and the server's output
        pid.json               the supervisor's pid and process start time (and its task)
        supervisor.json        restarts, last exit, the server's pid
        ready.json             written by the server once it serves
        crash                  (fake servers only) makes the fake server exit: for tests
        train.json             collective mode: the program copy's training figures (`top` reads them)

What outlives a cluster (kept by `dtf down` as a cache, removed by `dtf down --purge`) lives
beside the clusters, below WORKDIR/.cache (a cluster name cannot start with a dot):

    WORKDIR/.cache/env/<hash>/   a managed Python environment, named by a hash of its contents;
                                 complete once its ENV_MARKER exists (written last)
    WORKDIR/.cache/wheels/       the wheels dtf sent to build those (a flat directory)
    WORKDIR/.cache/bin/uv-<hash> the uv binary that builds them
    WORKDIR/.cache/sync/<hash>/  a tree sent by `dtf sync`, named by a hash of its contents

Paths are posix paths as the plan writes them (a leading ~/ is the host user's home).
"""

from __future__ import annotations

import posixpath

LAUNCHER_PREFIX = "launcher-"
LAUNCHER_SUFFIX = ".pyz"
OLD_LAUNCHER = "launcher.py"  # what dtf before the protocol version uploaded
HELPERS_PREFIX, HELPERS_SUFFIX = "dtf-", ".zip"
HELPERS_ENV = "DTF_HELPERS"  # the zip's path, in a collective `run`'s environment (its copies' PYTHONPATH)
LEASE = "lease.json"
EXPIRE_LOCK = ".expire-lock"
FENCE = "fence.json"
TOP_PREFIX = "top-"  # + pid + ".json": a running `top` stream's record (maintenance.cmd_top)
LOG = "log"
PID = "pid.json"
SUPERVISOR = "supervisor.json"
READY = "ready.json"
CRASH = "crash"
TRAIN = "train.json"  # the name dtf.program.figures writes


CACHE = ".cache"
ENV_MARKER = ".dtf-env.json"  # in a managed environment: written last, once it is complete


def cache_dir(workdir: str, kind: str = "") -> str:
    """WORKDIR/.cache, or WORKDIR/.cache/KIND ("env", "sync")."""
    return posixpath.join(workdir, CACHE, kind) if kind else posixpath.join(workdir, CACHE)


def synced_from_task(digest: str, subpath: str = "") -> str:
    """A synced tree (or the file in it) as a path relative to a task's directory: every server
    runs there (WORKDIR/CLUSTER/JOB-INDEX), so this one path is right on every host, whatever
    its WORKDIR or home directory."""
    return posixpath.join("..", "..", CACHE, "sync", digest, *filter(None, [subpath]))


def launcher_name(digest: str) -> str:
    return f"{LAUNCHER_PREFIX}{digest}{LAUNCHER_SUFFIX}"


def helpers_name(digest: str) -> str:
    """dtf's own package, zipped (collective mode's copies import it), beside the launcher."""
    return f"{HELPERS_PREFIX}{digest}{HELPERS_SUFFIX}"


def is_helpers(filename: str) -> bool:
    return filename.startswith(HELPERS_PREFIX) and filename.endswith(HELPERS_SUFFIX)


def is_launcher(filename: str) -> bool:
    return filename == OLD_LAUNCHER or (filename.startswith(LAUNCHER_PREFIX)
                                        and filename.endswith(LAUNCHER_SUFFIX))


def task_dir(root: str, job: str, index: int) -> str:
    return posixpath.join(root, f"{job}-{index}")


def in_task(root: str, job: str, index: int, filename: str) -> str:
    return posixpath.join(task_dir(root, job, index), filename)


def parse_name(text: str) -> tuple[str, int]:
    """A task's name, JOB:INDEX, as its job and index."""
    job, index = text.split(":")
    return job, int(index)
