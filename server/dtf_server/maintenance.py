"""The launcher's everyday commands on a running cluster: `status` (is each task alive, serving,
restarted how often), `top` (a stream of what each task uses), `log` (a task's log, without
TensorFlow's own lines unless asked), `renew` (the lease), `stop` (TERM each task's process group,
KILL after a grace; with `--clean`, `down` in one call) and `clean` (remove what dtf put in the
cluster's directory)."""

from __future__ import annotations

import collections
import contextlib
import os
import select
import shutil
import signal
import sys
import time
from typing import IO, Any

from dtf_server import firewall, sample, tflog
from dtf_server.procs import ours, port_open, proc_start_ticks, read_json, server_record, write_json
from dtf_server.protocol import (
    CleanReply,
    CleanRequest,
    Layout,
    LogRequest,
    RenewReply,
    RenewRequest,
    StatusReply,
    StatusRequest,
    StopReply,
    StopRequest,
    TaskSample,
    TaskStatus,
    TaskStopped,
    TopRequest,
    TopSample,
    encode,
)
from dtf_server.supervisor import read_lease, renew, running_tasks


def task_status(root: str, job: str, index: int) -> TaskStatus:
    tdir = Layout.task_dir(root, job, index)
    record = read_json(os.path.join(tdir, Layout.PID))
    if record is None:
        return TaskStatus.dead("never started")
    sup = read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {}
    alive = ours(record)  # the supervisor
    server_alive = alive and ours(server_record(sup))
    port = record.get("port")
    phase = sup.get("state", "starting") if alive else "dead"
    reason = None
    if phase == "failed":
        reason = f"gave up after {sup.get('restarts')} restart(s); last exit: {sup.get('last_exit')}"
    elif not alive:
        reason = "supervisor is gone"
    return TaskStatus(
        alive=alive, phase=phase, pid=record["pid"],
        server_pid=sup.get("server_pid") if server_alive else None,
        uptime=round(time.time() - sup["server_started"], 1) if server_alive else None,
        serving=bool(server_alive and port and port_open(port)),
        restarts=sup.get("restarts", 0), last_exit=sup.get("last_exit"), reason=reason)


def cmd_status(request: StatusRequest) -> StatusReply:
    lease = renew(request.dir, None) if request.renew else read_lease(request.dir)
    return StatusReply(tasks={t: task_status(request.dir, *Layout.parse_name(t)) for t in request.task}, lease=lease)


def cmd_top(request: TopRequest) -> None:
    """Print one TopSample line every `--interval` seconds until stdout's reader is gone (EPIPE:
    `dtf top` quit, or its SSH connection closed), the cluster's directory is gone, or `--for`
    seconds passed. It never renews the
    lease: a view left open does not keep an abandoned cluster alive. `--states-only` (dtf train's
    repair, which needs only each task's state): no /proc scan, no `ss`, no training figures."""
    tasks = [(t, *Layout.parse_name(t)) for t in request.task]
    record = os.path.join(request.dir, f"{Layout.TOP_PREFIX}{os.getpid()}.json")
    if os.path.isdir(request.dir):  # `clean` (`dtf down`) ends the streams it finds so recorded
        write_json(record, {"pid": os.getpid(), "start_ticks": proc_start_ticks(os.getpid())})
    try:
        stream_samples(request, tasks)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(record)


def stream_samples(request: TopRequest, tasks: list[tuple[str, str, int]]) -> None:
    before: dict[str, sample.Usage] = {}
    then = sample.clock()
    end = then + request.for_seconds
    while True:
        statuses = {name: task_status(request.dir, job, index) for name, job, index in tasks}
        leaders = {name: s.pid for name, s in statuses.items() if s.alive and s.pid is not None}
        now_usage = {} if request.states_only else sample.usage(leaders)
        now = sample.clock()
        samples = {}
        for name, status in statuses.items():
            u = now_usage.get(name)
            if u is None:
                samples[name] = TaskSample(status)
                continue
            cpu, net_in, net_out = sample.rates(before.get(name), u, now - then)
            train = read_json(Layout.in_task(request.dir, *Layout.parse_name(name), Layout.TRAIN))
            samples[name] = TaskSample(status, cpu=cpu, rss=u.rss, net_in=net_in, net_out=net_out,
                                       train=train if status.alive else None)
        before, then = now_usage, now
        try:
            print(encode(TopSample(tasks=samples, time=time.time(), lease=read_lease(request.dir))), flush=True)
        except BrokenPipeError:
            return
        if now >= end or not os.path.isdir(request.dir):  # the cluster is gone (`dtf down`, a lapsed lease)
            return
        if reader_gone(max(0.0, min(request.interval - (sample.clock() - now), end - now))):
            return


def reader_gone(timeout: float) -> bool:
    """Wait `timeout` seconds, or less: True as soon as stdout's reader is gone (its pipe or socket
    hung up: the SSH channel closed when `dtf top` quit or `dtf train` ended), so the stream and its
    record end then, not at the next sample's write. Stdout of another kind only waits."""
    poll = select.poll()
    poll.register(sys.stdout.fileno(), 0)  # no events asked: a hang-up or an error is always said
    return bool(poll.poll(timeout * 1000))


LOG_POLL = 0.2  # seconds between two looks at a followed log
PARTIAL_WAIT = 0.5  # a followed line still without its newline after this long is shown as far as it goes


def cmd_log(request: LogRequest) -> None:
    """A task's log (`dtf logs`): its last `--lines` lines, TensorFlow's own left out unless `--all`
    (dtf_server.tflog); with `--follow`, then its new lines as they come, until stdout's reader is
    gone (`dtf logs` ended: its SSH session's end also hangs up this process) or the task's
    directory is (`dtf down`, a lapsed lease). A log written anew (the cluster started again)
    is followed from its start. The whole log is read for the last lines: a line's verdict
    depends on the lines before it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C of a local `dtf logs` ends it without a traceback
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as `tail`: a reader gone ends it
    tdir = Layout.task_dir(request.dir, *Layout.parse_name(request.task))
    path = os.path.join(tdir, Layout.LOG)
    try:
        log = open(path, "rb")
    except FileNotFoundError:
        raise SystemExit(f"dtf: {request.task} has no log on this host ({path})")
    try:
        shown = tflog.Shown(everything=request.all)
        last: collections.deque[bytes] = collections.deque(maxlen=max(0, request.lines))
        while data := log.read(1 << 20):
            last.extend(shown.feed(data))
        if not request.follow and (unended := shown.partial()):
            last.append(unended)  # a last line without its newline counts, as `tail` counts it
        write_out(b"".join(last))
        if request.follow:
            follow_log(request.task, tdir, path, log, shown, request.all)
    finally:
        log.close()


def follow_log(task: str, tdir: str, path: str, log: IO[bytes], shown: tflog.Shown, everything: bool) -> None:
    """cmd_log's follow, from where `log` was read to."""
    grew = time.monotonic()  # when the line not ended yet last grew
    reopened: IO[bytes] | None = None
    try:
        while True:
            data = log.read(1 << 20)
            if data:
                write_out(b"".join(shown.feed(data)))
                grew = time.monotonic()
                continue
            if shown.pending and time.monotonic() - grew >= PARTIAL_WAIT:
                write_out(shown.partial())
            try:
                now = os.stat(path)
                if now.st_ino != os.fstat(log.fileno()).st_ino or now.st_size < log.tell():  # a new log
                    fresh = open(path, "rb")
                    if reopened is not None:
                        reopened.close()
                    log = reopened = fresh
                    shown = tflog.Shown(everything)
                    continue
            except FileNotFoundError:
                if not os.path.isdir(tdir):
                    sys.stderr.write(f"dtf: {task}'s log is gone (the cluster was taken down, or its lease lapsed)\n")
                    return
            if reader_gone(LOG_POLL):
                return
    finally:
        if reopened is not None:
            reopened.close()


def write_out(data: bytes) -> None:
    """All of `data` to stdout, unbuffered (os.write may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def cmd_renew(request: RenewRequest) -> RenewReply:
    return RenewReply(lease=renew(request.dir, request.ttl))


def cmd_stop(request: StopRequest) -> StopReply:
    # Per running task: its process group (the supervisor's pid) and the processes to see gone,
    # supervisor and server.
    groups: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    for t in request.task:
        tdir = Layout.task_dir(request.dir, *Layout.parse_name(t))
        record = read_json(os.path.join(tdir, Layout.PID))
        server = server_record(read_json(os.path.join(tdir, Layout.SUPERVISOR)) or {})
        members = [r for r in (record, server) if r is not None and ours(r)]
        if record and members:
            groups[t] = (record["pid"], members)
    killed: set[str] = set()

    def alive(t: str) -> bool:
        return any(ours(m) for m in groups[t][1])

    def signal_group(t: str, sig: int) -> None:
        # The group outlives its leader while any member lives, and Linux never hands out a pid
        # that is still a group's id: a group with a live member of ours is still ours.
        if alive(t):
            try:
                os.killpg(groups[t][0], sig)
            except ProcessLookupError:
                pass

    def wait(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(alive(t) for t in groups) and time.monotonic() < deadline:
            time.sleep(0.01)  # (a supervisor and its server go soon after TERM: `down` waits on this)

    for t in groups:
        signal_group(t, signal.SIGTERM)
    wait(request.grace)
    for t in groups:
        if alive(t):
            signal_group(t, signal.SIGKILL)
            killed.add(t)
    wait(5)
    stopped = {t: TaskStopped(was_running=t in groups, killed=t in killed, gone=t not in groups or not alive(t))
               for t in request.task}
    cleaned = None
    if request.clean and all(s.gone for s in stopped.values()):
        cleaned = cmd_clean(CleanRequest(dir=request.dir, keep_logs=request.keep_logs))
    return StopReply(tasks=stopped, cleaned=cleaned)



def end_streams(root: str) -> None:
    """TERM every `top` stream of the cluster (a reader may be gone without closing it: a killed
    `dtf train`), and wait until they are gone."""
    streams: list[dict[str, Any]] = []
    for name in os.listdir(root):
        record = read_json(os.path.join(root, name)) if name.startswith(Layout.TOP_PREFIX) else None
        if record is not None and ours(record):
            streams.append(record)
    for r in streams:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 5
    while any(ours(r) for r in streams) and time.monotonic() < deadline:
        time.sleep(0.01)


def cmd_clean(request: CleanRequest) -> CleanReply:
    """What `down` ends with on every host (`stop --clean`): the firewall rules first, then the
    tasks' files and the launchers. A directory another dtf's tasks use (`--if-unused`) is left
    alone; a task whose server still runs is refused."""
    removed: list[str] = []
    if not os.path.isdir(request.dir):
        return CleanReply(removed=removed)
    if request.if_unused and running_tasks(request.dir):
        return CleanReply(removed=removed, in_use=True)  # another dtf's tasks live here: not ours
    end_streams(request.dir)
    from dtf_server.sshkeys import deauthorize, end_connections

    end_connections(request.dir)  # a detached run's SSH connections from here, and its key
    refused = deauthorize(request.dir)
    if refused:
        raise SystemExit(f"cannot remove the detached run's key from {refused}")
    if any(os.path.exists(os.path.join(request.dir, name)) for name in (Layout.FIREWALL, firewall.EARLIER)):
        # The firewall rules first: they outlive no cluster.
        rules = firewall.remove(request.dir)
        if rules.error:
            raise SystemExit(f"cannot remove the TF ports' firewall rules: {rules.error}")
    for name in sorted(os.listdir(request.dir)):
        path = os.path.join(request.dir, name)
        if os.path.isdir(path) and not os.path.islink(path) and name != "__pycache__":
            if ours(read_json(os.path.join(path, Layout.PID))):
                raise SystemExit(f"refusing to clean {path}: its server is still running")
            for entry in os.listdir(path):
                if request.keep_logs and entry == Layout.LOG:
                    continue
                target = os.path.join(path, entry)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)  # written by the server (a relative path in a program)
                else:
                    os.unlink(target)
                removed.append(target)
            if not os.listdir(path):
                os.rmdir(path)
        elif (Layout.is_launcher(name) or Layout.is_helpers(name)
              or name in (Layout.LEASE, Layout.EXPIRE_LOCK, Layout.AUTHORIZED)
              or name.startswith(Layout.TOP_PREFIX)
              or ".tmp-" in name):
            os.unlink(path)  # every launcher version (and dtf's package), and uploads that never completed
            removed.append(path)
    if os.path.isdir(pycache := os.path.join(request.dir, "__pycache__")):
        shutil.rmtree(pycache, ignore_errors=True)
    if not os.listdir(request.dir):
        os.rmdir(request.dir)
    return CleanReply(removed=removed)
