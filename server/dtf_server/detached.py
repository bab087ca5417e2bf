"""A detached run's commands on its hosts (`dtf train --detach`; the laptop's side is dtf.detached).

- `authorize`, on every other host of the cluster: lets the coordinator's host in over SSH with the
  run's key (dtf_server.sshkeys), and says the login, the sshd port and the host keys this host's
  sshd shows, scanned here: what the coordinator's host needs to reach it and to trust it.
- `detached`, on the coordinator's host: whether the run runs, how it ended, its figures and the
  placement of the tasks as its coordinator knows it; `--collect` gathers what the program wrote
  for the laptop to fetch (DetachedLayout.BACK); `--fresh` clears an ended run's files.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
from typing import Any

from dtf_server import sshkeys
from dtf_server.procs import ours, read_json, write_json
from dtf_server.program import ending
from dtf_server.protocol import (
    AuthorizeReply,
    AuthorizeRequest,
    DetachedLayout,
    DetachedReply,
    DetachedRequest,
    Layout,
)

SCAN_TIMEOUT = 5  # seconds ssh-keyscan gets to read this host's own sshd


def _host_keys() -> list[str]:
    """The keys this host's sshd shows (the address and port this session came in at, from
    SSH_CONNECTION), read here with ssh-keyscan: what the coordinator's host will trust for it.
    None where this session is no SSH session or the host has no ssh-keyscan."""
    parts = os.environ.get("SSH_CONNECTION", "").split()
    scan = shutil.which("ssh-keyscan")
    if len(parts) != 4 or scan is None:
        return []
    try:
        r = subprocess.run([scan, "-T", str(SCAN_TIMEOUT), "-p", parts[3], parts[2]], capture_output=True,
                           text=True, timeout=SCAN_TIMEOUT * 4, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    keys = []
    for line in r.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 3 and not line.startswith("#"):
            keys.append(f"{fields[1]} {fields[2]}")
    return sorted(set(keys))


def cmd_authorize(request: AuthorizeRequest) -> AuthorizeReply:
    user = pwd.getpwuid(os.getuid()).pw_name
    keys = _host_keys()
    parts = os.environ.get("SSH_CONNECTION", "").split()
    port = int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else None
    if not sshkeys.KEY.match(request.key) or not all(sshkeys.NAME.match(a) for a in request.allow):
        return AuthorizeReply(user=user, host_keys=keys, port=port, error="not a public key, or not addresses")
    os.makedirs(request.dir, exist_ok=True)
    lease = sshkeys.read_lease(request.dir)
    token = secrets.token_hex(8)
    path = sshkeys.authorized_keys()
    record = read_json(os.path.join(request.dir, Layout.AUTHORIZED)) or {}
    try:
        with sshkeys.ssh_dir_locked():
            created = not os.path.exists(path) if not record else bool(record.get("created"))
            expires = sshkeys.expires(lease, request.ttl)
            allow = sshkeys.allowed(request.allow)
            line = sshkeys.key_line(request.key, allow, expires, token)
            sshkeys.rewrite(path, f"{sshkeys.MARK}:{record.get('token', token)}", line)
    except OSError as e:
        return AuthorizeReply(user=user, host_keys=keys, port=port, error=f"{path}: {e.strerror or e}")
    write_json(os.path.join(request.dir, Layout.AUTHORIZED),
               {"file": path, "token": token, "key": request.key, "allow": allow, "expires": expires,
                "created": created})
    return AuthorizeReply(user=user, host_keys=keys, port=port)


# -- the run, on the coordinator's host -------------------------------------------------------
def cmd_detached(request: DetachedRequest) -> DetachedReply:
    if request.fresh:
        job, index = Layout.parse_name(Layout.CHIEF)
        if ours(read_json(Layout.in_task(request.dir, job, index, Layout.PID))):
            return cmd_detached(DetachedRequest(dir=request.dir))  # still running: nothing removed
        shutil.rmtree(DetachedLayout.dir(request.dir), ignore_errors=True)
        shutil.rmtree(Layout.task_dir(request.dir, job, index), ignore_errors=True)  # how the last one ended
        os.makedirs(DetachedLayout.dir(request.dir))
        return DetachedReply(state="none")
    spec = read_json(DetachedLayout.path(request.dir, DetachedLayout.SPEC))
    if not spec:
        return DetachedReply(state="none")
    job, index = Layout.parse_name(Layout.CHIEF)
    tdir = Layout.task_dir(request.dir, job, index)
    running = ours(read_json(os.path.join(tdir, Layout.PID)))
    log = DetachedLayout.path(request.dir, DetachedLayout.OUTPUT_LOG)
    size = os.path.getsize(log) if os.path.exists(log) else 0
    common: dict[str, Any] = {"run_id": str(spec.get("run_id", "")), "started": spec.get("started"), "size": size}
    common.update(_placement(request.dir))
    if running:
        return DetachedReply(state="running", run=_figures(request.dir), **common)
    code, reason, ended = ending(request.dir)
    collected = collect(request.dir) if request.collect else None
    return DetachedReply(state="ended", exit_code=code, reason=reason, ended=ended, collected=collected, **common)


def _figures(root: str) -> dict[str, Any] | None:
    """The coordinator's figures (dtf.program.figures: run.json, and the program's train.json
    under "train"), in the detached run's DTF_HOME."""
    found = sorted(glob.glob(os.path.join(DetachedLayout.path(root, DetachedLayout.HOME), "live", "*", "run.json")))
    if not found:
        return None
    run = read_json(found[0]) or {}
    train = read_json(os.path.join(os.path.dirname(found[0]), Layout.TRAIN))
    if train is not None:
        run["train"] = train
    return run


def _placement(root: str) -> dict[str, Any]:
    """Where the coordinator's record places each task now (tasks moved to a spare), the hosts it
    retired, and what it did to bring tasks back."""
    found = glob.glob(os.path.join(DetachedLayout.path(root, DetachedLayout.HOME), "state", "*.json"))
    record = read_json(found[0]) if found else None
    if not record:
        return {}
    try:
        plan = record["plan"]
        return {"placement": {h["spec"]["host"]: [f"{t['job']}:{t['index']}" for t in h["tasks"]]
                              for h in plan["hosts"]},
                "retired": [h["spec"]["host"] for h in plan.get("retired", ())],
                "recovered": {str(k): str(v) for k, v in record.get("recovered", {}).items()}}
    except (KeyError, TypeError):
        return {}


def collect(root: str) -> int:
    """What the program wrote, in BACK for the laptop to fetch: the files of work/ it made or
    changed (not as shipped: size and mtime), and every file of output/. Hard links where the
    file system has them. How many files."""
    back = DetachedLayout.path(root, DetachedLayout.BACK)
    shutil.rmtree(back, ignore_errors=True)
    shipped = read_json(DetachedLayout.path(root, DetachedLayout.SHIPPED)) or {}
    count = 0
    for part, skip in ((DetachedLayout.WORK, shipped), (DetachedLayout.OUTPUT, {})):
        source = DetachedLayout.path(root, part)
        for directory, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, source)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if not os.path.isfile(path) or skip.get(rel) == [st.st_size, st.st_mtime_ns]:
                    continue
                target = os.path.join(back, part, rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)
                count += 1
    return count
