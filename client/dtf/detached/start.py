"""`dtf train --detach`: start the program as the cluster's coordinator on a host of the cluster.

In order, from the laptop, every step with a deadline (a failure says which host and why, and
nothing is started):
1. The coordinator's host (dtf.detached.vantage.coordinator_host) is asked whether its python has
   what the program imports (TensorFlow, tf-keras, the program's own top-level imports), and,
   where it must reach other hosts over SSH, an `ssh` and an `ssh-keygen`.
2. The program's folder goes there as `dtf sync` sends a tree (its .gitignore files apply), within
   SHIP_LIMIT; dtf's own package goes beside the launcher, as for collective mode's copies.
3. SSH hosts: the coordinator's host makes a key for this run; every other host and spare lets it
   in (dtf_server.detached: `authorize`), and says its login, sshd port and host keys.
4. The run's spec (DetachedLayout.SPEC) goes there, and the coordinator starts as a supervised
   task of the host (on Slurm, a job step of the allocation: the launcher's `run-step`).
5. Once its attempts have begun (its figures appear), the record keeps the run (Record.detached)
   and one line says where it runs and how to follow it.
"""

from __future__ import annotations

import ast
import json
import posixpath
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtf.cluster import state
from dtf.cluster.plan import HostPlan
from dtf.cluster.state import DetachedRun, Record
from dtf.detached import vantage
from dtf.detached.remote import ask_state, run_dir, settle
from dtf.errors import ClusterDown, HostFailure, UsageError
from dtf.files import shipping, sync
from dtf.hostops import launcher, syncing
from dtf.hostops.parallel import HostOps
from dtf.hosts.base import HostError
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf_server.protocol import (
    AuthorizeReply,
    AuthorizeRequest,
    DetachedLayout,
    DetachedReply,
    DetachedRequest,
    Layout,
    TaskSpec,
)

SHIP_LIMIT = 200 * 2**20  # bytes of the program's folder that --detach ships
START_WAIT = 120.0  # seconds the coordinator gets to begin its first attempt
ASK_TIMEOUT = 60.0  # seconds for one of the steps' launcher commands
KEYGEN = "ssh-keygen"

Say = Callable[[str], None]


def megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def check_combination(record: Record, program: Path, collective: bool) -> HostPlan:
    """What --detach cannot do, refused in one line before anything is sent; the coordinator's host."""
    if program.suffix == ".ipynb":
        raise UsageError("--detach runs a Python program (.py); a notebook runs attached (`dtf train "
                         f"{program}`, or from Jupyter with dtf.connect())")
    if collective:
        raise UsageError("--detach with --collective: not supported (the copies run on the hosts already, and "
                         "`dtf train --collective` follows them from here); run it attached")
    plan = record.plan
    chief = vantage.coordinator_host(plan)
    local = [hp.name for hp in (*plan.hosts, *plan.spares) if hp.spec.local]
    if local and len(local) < len(plan.hosts) + len(plan.spares):
        raise UsageError(f"--detach: {', '.join(local)} is this machine (connection: local), which a coordinator "
                         f"on {chief.name} cannot reach; detach on a cluster of SSH hosts, or of local ones only")
    return chief


def program_imports(program: Path) -> list[str]:
    """The top-level modules the program imports (absolute imports, anywhere in the file), less
    the standard library's and the modules of the program's own folder."""
    try:
        tree = ast.parse(program.read_bytes(), filename=str(program))
    except (SyntaxError, ValueError):
        return []  # the program's own error: it shows when it runs
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    folder = program.parent
    own = {n for n in names if (folder / f"{n}.py").exists() or (folder / n).is_dir()}
    return sorted(names - set(sys.stdlib_module_names) - own - {"dtf", "__future__"})


_CHECK = """
import importlib.util, json, shutil, sys
missing = [m for m in sys.argv[2:] if importlib.util.find_spec(m) is None]
print(json.dumps({"missing": missing, "ssh": [t for t in ("ssh", "ssh-keygen") if shutil.which(t) is None]
                  if sys.argv[1] == "ssh" else []}))
"""


def check_host(ops: HostOps, hp: HostPlan, program: Path, ssh: bool) -> None:
    """The coordinator's host has what the program imports, and SSH's client where it needs one."""
    # tf.keras is tf-keras under dtf (TF_USE_LEGACY_KERAS): a program that names keras needs it.
    keras = ["tf_keras"] if b"keras" in program.read_bytes() else []
    modules = ["tensorflow", *keras, *program_imports(program)]
    with ops.runner(hp) as t:
        r = t.run([hp.python, "-c", _CHECK, "ssh" if ssh else "-", *dict.fromkeys(modules)], timeout=ASK_TIMEOUT)
    try:
        found = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
        raise HostFailure("--detach", {hp.name: f"its python ({hp.python}) did not answer: {why}"})
    if found["missing"]:
        raise UsageError(f"--detach: {hp.name}'s python ({hp.python}) has no {', '.join(found['missing'])}, which "
                         f"the program needs there (add it to the inventory's `packages:` with `python: managed`, "
                         f"or install it there, or name another host with `coordinator:`)")
    if found["ssh"]:
        raise UsageError(f"--detach: {hp.name} has no {' or '.join(found['ssh'])} (OpenSSH's client), which the "
                         f"coordinator there needs to reach the other hosts (install openssh-client there, or name "
                         f"another host with `coordinator:`)")


def pack_program(program: Path, limit: int = SHIP_LIMIT) -> sync.Pack:
    """The program's folder, as `dtf sync` packs it; refused above `limit` bytes, naming the largest files."""
    root = program.resolve().parent
    try:
        listed = sync.list_files(root)
    except sync.SyncError as e:
        raise UsageError(f"--detach: {e}")
    sizes = sorted(((name, path.stat().st_size) for name, path in listed.files), key=lambda f: -f[1])
    total = sum(size for _, size in sizes)
    if total > limit:
        largest = ", ".join(f"{name} ({megabytes(size)})" for name, size in sizes[:3])
        raise UsageError(f"--detach: the program's folder {root} holds {megabytes(total)} to send, more than "
                         f"{megabytes(limit)} (largest: {largest}): list what the program does not need in a "
                         f".gitignore there, send its data with `dtf sync` (dtf.synced()), or keep the program "
                         f"in a folder of its own")
    try:
        return sync.pack(root, "program")
    except sync.SyncError as e:
        raise UsageError(f"--detach: {e}")


def placed(path: Path, cwd: Path, elsewhere: str) -> str:
    """Where a laptop path lives in the run's directory: below work/ as it is below the working
    directory, else at `elsewhere`."""
    try:
        return posixpath.normpath(posixpath.join(DetachedLayout.WORK, path.relative_to(cwd).as_posix()))
    except ValueError:
        return elsewhere


def authorize(ops: HostOps, chief: HostPlan, run: str, say: Say) -> dict[str, dict[str, Any]]:
    """The run's key, made on the coordinator's host; every other SSH host and spare lets it in
    from there: host -> {user, port, host_keys}, as the run's spec keeps it."""
    plan = ops.plan
    others = [hp for hp in (*plan.hosts, *plan.spares) if hp.name != chief.name and hp.spec.over_ssh]
    if not others:
        return {}
    key = posixpath.join(run, DetachedLayout.SSH, "key")
    with ops.runner(chief) as t:
        r = t.run(["mkdir", "-p", "-m", "700", posixpath.dirname(key)], timeout=ASK_TIMEOUT)
        r = t.run([KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "dtf-coordinator", "-f", key], timeout=ASK_TIMEOUT)
        pub = t.run(["cat", key + ".pub"], timeout=ASK_TIMEOUT) if r.ok else r
    if not pub.ok:
        raise HostFailure("--detach: making the cluster key", {chief.name: (pub.stderr.strip().splitlines()
                                                                            or [f"exit {pub.exit_code}"])[-1]})
    public = " ".join(pub.stdout.split()[:2])
    allow = [vantage.address_of(chief)]

    def one(hp: HostPlan) -> AuthorizeReply:
        with ops.runner(hp) as t:
            reply = launcher.ask(t, hp, AuthorizeReply,
                                 hp.launcher_argv(AuthorizeRequest(dir=hp.root, key=public, allow=allow, ttl=hp.ttl)),
                                 "letting the coordinator's host in", ASK_TIMEOUT)
        if reply.error:
            raise HostError(f"letting the coordinator's host in: {reply.error}")
        if reply.port is None:
            raise HostError("letting the coordinator's host in: no SSH_CONNECTION in its session")
        return reply

    outcomes = ops.each_host(one, others)
    failed = {h: o.reason for h, o in outcomes.items() if not o.ok}
    if failed:
        raise HostFailure("--detach", failed)
    unscanned = [h for h, o in outcomes.items() if not o.value.host_keys]
    if unscanned:
        say(f"warning: {', '.join(unscanned)} cannot show its host keys (no ssh-keyscan there): the coordinator "
            f"on {chief.name} trusts the key it first sees there")
    return {h: {"user": o.value.user, "port": o.value.port, "host_keys": o.value.host_keys}
            for h, o in outcomes.items()}


def coordinator_spec(hp: HostPlan) -> TaskSpec:
    from dtf.program.runner import python_m

    job, index = Layout.parse_name(Layout.CHIEF)
    return TaskSpec(job=job, index=index, port=0,
                    argv=python_m("dtf.detached.coordinator", run_dir(hp), python=hp.python))


def start_coordinator(ops: HostOps, hp: HostPlan) -> None:
    """The coordinator as a supervised task of its host: started by its launcher's `run`, or on
    Slurm by a job step of the allocation that `run --spawned` waits for."""
    from dtf.collective.run import run_argv, run_step_argv
    from dtf_server.protocol import Defaults, StartReply

    spec = coordinator_spec(hp)
    token = uuid.uuid4().hex[:16]
    step = run_step_argv(hp, [(hp.name, spec)], False, token)
    spawned = token if ops.provider.start_copies([hp], 1, step, gpus=False) else ""  # the workers' GPUs
    with ops.runner(hp) as t:
        reply = launcher.ask(t, hp, StartReply, run_argv(hp, [spec], False, spawned), "starting the coordinator",
                             ASK_TIMEOUT + (Defaults.RUN_STEP_WAIT if spawned else 0))
    started = reply.tasks.get(Layout.CHIEF)
    if started is None or not started.ok:
        why = started.reason if started is not None else "no reply for it"
        tail = f": {started.log_tail[-1]}" if started is not None and started.log_tail else ""
        raise HostFailure("--detach: starting the coordinator", {hp.name: f"{why}{tail}"})


def last_lines(ops: HostOps, hp: HostPlan, n: int = 5) -> list[str]:
    """The run's last lines; where it printed none (it failed before it could), its task's log's."""
    job, index = Layout.parse_name(Layout.CHIEF)
    with ops.runner(hp) as t:
        for path in (posixpath.join(run_dir(hp), DetachedLayout.OUTPUT_LOG), Layout.in_task(hp.root, job, index,
                                                                                              Layout.LOG)):
            r = t.run(["tail", "-n", str(n), path], timeout=ASK_TIMEOUT)
            lines = [line for line in r.stdout.splitlines() if line.strip()] if r.ok else []
            if lines:
                return lines
    return []


def wait_started(ops: HostOps, hp: HostPlan, wait: float = START_WAIT) -> None:
    """Until the coordinator has begun its attempts (its figures are there), or it ended (its last
    lines said), or `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        reply = ask_state(ops, hp)
        if reply.state == "running" and reply.run is not None:
            return
        if reply.state != "running":
            lines = last_lines(ops, hp)
            said = next((line.removeprefix("dtf: error: ") for line in reversed(lines) if "rror" in line),
                        lines[-1] if lines else reply.reason)
            raise ClusterDown(f"--detach: the coordinator on {hp.name} ended before the program started: {said}")
        if time.monotonic() > deadline:
            raise ClusterDown(f"--detach: the coordinator on {hp.name} has not begun after {wait:g}s "
                              f"(`dtf attach` shows what it says)")
        time.sleep(0.5)


def detach(record: Record, program: Path, args: list[str], output: Path | None, *, attempts: int, ps_wait: float,
           network_wait: float, connect_timeout: float = CONNECT_TIMEOUT, verbose: bool = False,
           hook_env: dict[str, str] | None = None, collective: bool = False,
           say: Say = lambda line: None) -> DetachedRun:
    """Start the run (see the module's doc); the record keeps it. A detached run still running
    on the cluster is refused; one that ended with outputs not brought back brings them first."""
    chief = check_combination(record, program, collective)
    ops = HostOps(record.plan, connect_timeout=connect_timeout)
    if record.detached is not None:
        record = settle(record, ops, say)
    ssh_needed = any(hp.spec.over_ssh and hp.name != chief.name
                     for hp in (*record.plan.hosts, *record.plan.spares))
    check_host(ops, chief, program, ssh_needed)
    pack = pack_program(program)
    cwd = Path.cwd().resolve()
    root = program.resolve().parent
    program_dir = placed(root, cwd, "program")
    out = output.resolve() if output is not None else None
    out_place = placed(out, cwd, DetachedLayout.OUTPUT) if out is not None else None
    run = run_dir(chief)
    with ops.runner(chief) as t:  # dtf's own package, beside the launcher (the coordinator imports it)
        reply = launcher.ask(t, chief, DetachedReply,
                             chief.launcher_argv(DetachedRequest(dir=chief.root, fresh=True)),
                             "clearing the last detached run", ASK_TIMEOUT)
        if reply.state == "running":
            raise UsageError(f"a detached run already runs on {chief.name} (`dtf attach` follows it)")
        t.put_bytes(shipping.helpers_bytes(), chief.root, shipping.helpers_name())
    sent = syncing.send(ops, [pack], [chief])
    failed = {h: o.reason for h, o in sent.items() if not o.ok}
    if failed:
        raise HostFailure("--detach: sending the program", failed)
    ssh = authorize(ops, chief, run, say)
    run_id = uuid.uuid4().hex[:12]
    started = time.time()
    spec = {"run_id": run_id, "started": started, "here": chief.name, "record": record.to_dict(),
            "program": posixpath.join(program_dir, program.name), "program_dir": program_dir,
            "shipped_from": Layout.synced_from_task(pack.digest), "args": list(args), "output": out_place,
            "ssh": ssh, "options": {"attempts": attempts, "ps_wait": ps_wait, "network_wait": network_wait,
                                    "connect_timeout": connect_timeout, "verbose": verbose,
                                    "hook_env": dict(hook_env or {})}}
    with ops.runner(chief) as t:
        t.put_bytes(json.dumps(spec).encode(), run, DetachedLayout.SPEC)
    start_coordinator(ops, chief)
    detached = DetachedRun(run_id=run_id, host=chief.name, program=str(program), started=started, cwd=str(cwd),
                           output=str(out) if out is not None and out_place == DetachedLayout.OUTPUT else None)
    keep(record, detached)
    from dtf.detached.attach import remove_cursor

    remove_cursor(state.home(), record.cluster)
    wait_started(ops, chief)
    return detached


def keep(record: Record, detached: DetachedRun | None) -> Record:
    """The cluster's record, as it is now on disk, with this detached run (None: none)."""
    with state.locked():
        now = state.load(record.cluster)
        if now.created != record.created:
            raise UsageError(f"cluster {record.cluster!r} was replaced meanwhile")
        now = now.replace(detached=detached)
        state.save(now)
    return now
