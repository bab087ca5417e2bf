#!/usr/bin/env python3
"""dtf's launcher: the one file dtf uploads to each host. Standard library plus TensorFlow only.

It never imports the dtf client, so a host needs nothing but a python with TensorFlow.
Every subcommand prints one JSON document on stdout and exits 0 when it did what was asked.

    check     --port P ...                     versions, busy ports, the SSH client's address
    start     --dir D --task JOB:INDEX:PORT ...  start supervised servers detached, wait until each serves
    supervise --dir D --task JOB:INDEX:PORT      (internal) run one server, restart it when it dies
    serve     --job J --index I --port P --ready F  (internal) run one tf.distribute.Server
    status    --dir D --task JOB:INDEX ...     is each task alive, serving, restarted how often
    renew     --dir D [--ttl S]                renew the cluster's lease on this host
    stop      --dir D --task JOB:INDEX ...     TERM the task's process group, KILL after a grace
    clean     --dir D [--keep-logs] [--if-unused]  remove what dtf put in D

Each task is a supervisor process (its own session and process group) with the server as its
child in the same group: one `killpg` stops both. The supervisor restarts a server that dies, on
the same port, after a backoff (`--restart-backoff`, doubling for deaths in quick succession, at
most RESTART_MAX_BACKOFF), at most `--restart-limit` times; then it gives up and stays, server-less,
until stopped or its lease lapses.

The lease: D/lease.json holds {ttl, renewed} (this host's clock). dtf renews it while it uses the
cluster (`up`, `status`, `train`...). When `renewed + ttl` has passed, every supervisor stops its
server and the last one removes D entirely: an abandoned cluster cleans itself up. ttl 0: never.

Files of a task live in D/JOB-INDEX/: `log` (the supervisor's and the server's output),
`pid.json` (the supervisor's pid and process start time: a pid is only ever signalled if its start
time still matches, so dtf never kills a process it did not start), `ready.json` (written by the
server once it serves), `supervisor.json` (restarts, last exit reason, the server's pid).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

READY_POLL = 0.05
SUPERVISE_POLL = 0.2  # how often a supervisor looks at its server
LEASE_POLL = 1.0  # how often a supervisor reads the lease
STABLE_AFTER = 60.0  # a server that ran this long before dying restarts with the base backoff
RESTART_MAX_BACKOFF = 60.0
STOP_GRACE = 5.0  # a supervisor gives its server this long after TERM, then KILLs it


def task_dir(root: str, job: str, index: int) -> str:
    return os.path.join(root, f"{job}-{index}")


def serve_argv(python: str, launcher: str, job: str, index: int, port: int, ready: str) -> list[str]:
    """The command that runs one server (the client's plan shows the same; a test keeps them equal)."""
    return [python, launcher, "serve", "--job", job, "--index", str(index), "--port", str(port),
            "--ready", ready]


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has finished; only its parent's wait is missing
        return None
    return int(fields[19])


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def ours(record: dict | None) -> bool:
    """True if the process recorded in a pid.json is alive and is the one we started."""
    if not record:
        return False
    return proc_start_ticks(record["pid"]) == record["start_ticks"]


def server_record(sup: dict) -> dict | None:
    """The server a supervisor.json names, as a record `ours` checks (None: no server now)."""
    if not sup.get("server_pid"):
        return None
    return {"pid": sup["server_pid"], "start_ticks": sup.get("server_ticks")}


def port_busy(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Like gRPC: SO_REUSEADDR, so a port left in TIME_WAIT by a stopped server counts as free.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))  # TF servers always listen on 0.0.0.0 (FACTS.md)
        return False
    except OSError:
        return True
    finally:
        s.close()


def port_open(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: str, lines: int = 20) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def die_with_parent() -> None:
    """In a supervisor's child, before exec: be killed when the supervisor dies, however it dies
    (Linux's PR_SET_PDEATHSIG), so a server never outlives the process that answers for it."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def exit_reason(code: int) -> str:
    """What a Popen returncode means, in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def log_line(message: str) -> None:
    """One line in the task's log (the supervisor's stdout is the log)."""
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} dtf: {message}", flush=True)


def lease_path(root: str) -> str:
    return os.path.join(root, "lease.json")


def write_lease(root: str, ttl: float) -> dict:
    lease = {"ttl": ttl, "renewed": time.time()}
    write_json(lease_path(root), lease)
    return lease


def tf_version() -> str | None:
    from importlib import metadata

    for name in ("tensorflow", "tensorflow-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def parse_task(text: str, with_port: bool) -> tuple:
    parts = text.split(":")
    if with_port:
        job, index, port = parts
        return job, int(index), int(port)
    job, index = parts
    return job, int(index)


# ---------------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> dict:
    client = os.environ.get("SSH_CONNECTION", "").split()
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "tensorflow": tf_version(),
        "busy": [p for p in args.port if port_busy(p)],
        "client_address": client[0] if client else None,
        "running": running_tasks(args.dir) if args.dir else [],
    }


def running_tasks(root: str) -> list[str]:
    """Tasks below `root` whose supervisor is alive (as JOB:INDEX)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        record = read_json(os.path.join(root, name, "pid.json"))
        if ours(record):
            found.append(f"{record['job']}:{record['index']}")
    return found


def supervise_argv(python: str, launcher: str, root: str, job: str, index: int, port: int,
                   limit: int, backoff: float) -> list[str]:
    return [python, launcher, "supervise", "--dir", root, "--task", f"{job}:{index}:{port}",
            "--restart-limit", str(limit), "--restart-backoff", f"{backoff:g}"]


def cmd_start(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    launcher = os.path.abspath(__file__)
    os.makedirs(args.dir, exist_ok=True)
    write_lease(args.dir, args.ttl)  # before any supervisor starts reading it
    started: dict[str, dict] = {}
    for spec in args.task:
        job, index, port = parse_task(spec, with_port=True)
        name = f"{job}:{index}"
        tdir = task_dir(args.dir, job, index)
        os.makedirs(tdir, exist_ok=True)
        record = read_json(os.path.join(tdir, "pid.json"))
        if ours(record) and record.get("port") == port:
            started[name] = {"pid": record["pid"], "already": True, "port": port, "dir": tdir}
            continue
        for stale in ("ready.json", "supervisor.json"):  # left by an earlier run
            if os.path.exists(os.path.join(tdir, stale)):
                os.unlink(os.path.join(tdir, stale))
        log = open(os.path.join(tdir, "log"), "ab")
        proc = subprocess.Popen(
            supervise_argv(sys.executable, launcher, args.dir, job, index, port,
                           args.restart_limit, args.restart_backoff),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tdir,
            start_new_session=True,  # its own session: survives the SSH session, one group to kill
            close_fds=True,
        )
        log.close()
        record = {"pid": proc.pid, "start_ticks": proc_start_ticks(proc.pid), "job": job,
                  "index": index, "port": port, "started": time.time()}
        write_json(os.path.join(tdir, "pid.json"), record)
        started[name] = {"pid": proc.pid, "already": False, "port": port, "dir": tdir,
                         "proc": proc, "ready": os.path.join(tdir, "ready.json")}

    # Ready means: the server wrote ready.json after tf.distribute.Server started, AND its port
    # accepts a connection. A server that dies first has crashed (its supervisor would restart
    # it, but a server that cannot start is a mistake to report): report its log's last lines.
    deadline = time.monotonic() + args.timeout
    results: dict[str, dict] = {}
    pending = {n: t for n, t in started.items() if not t["already"]}
    for n, t in started.items():
        if t["already"]:
            results[n] = {"ok": True, "pid": t["pid"], "already": True}
    while pending and time.monotonic() < deadline:
        for n, t in list(pending.items()):
            code = t["proc"].poll()
            died = (read_json(os.path.join(t["dir"], "supervisor.json")) or {}).get("last_exit")
            if code is not None or died:
                reason = f"server {died}" if died else f"supervisor {exit_reason(code)}"
                results[n] = {"ok": False, "pid": t["pid"], "reason": reason,
                              "log_tail": tail(os.path.join(t["dir"], "log"))}
                del pending[n]
            elif os.path.exists(t["ready"]) and port_open(t["port"]):
                results[n] = {"ok": True, "pid": t["pid"], "already": False}
                del pending[n]
        if pending:
            time.sleep(READY_POLL)
    for n, t in pending.items():
        results[n] = {"ok": False, "pid": t["pid"],
                      "reason": f"not serving after {args.timeout:g}s",
                      "log_tail": tail(os.path.join(t["dir"], "log"))}
    return {"tasks": results}


class Supervisor:
    """Keeps one task's server running; see the module's docstring for the policy."""

    def __init__(self, root: str, job: str, index: int, port: int, limit: int, backoff: float) -> None:
        self.root, self.job, self.index, self.port = root, job, index, port
        self.limit, self.backoff = limit, backoff
        self.name = f"{job}:{index}"
        self.dir = task_dir(root, job, index)
        self.ready = os.path.join(self.dir, "ready.json")
        self.stopping = False
        self.server: subprocess.Popen | None = None
        self.state = {"state": "starting", "restarts": 0, "last_exit": None,
                      "server_pid": None, "server_ticks": None, "server_started": None}
        self.lease: dict | None = None
        self.lease_read = 0.0

    def save(self, **changes: object) -> None:
        self.state.update(changes)
        write_json(os.path.join(self.dir, "supervisor.json"), self.state)

    def on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)

    def lease_lapsed(self) -> bool:
        now = time.monotonic()
        if now - self.lease_read >= LEASE_POLL:
            self.lease_read = now
            self.lease = read_json(lease_path(self.root)) or self.lease  # unreadable: keep the last
        if not self.lease or not self.lease.get("ttl"):
            return False
        return time.time() > self.lease["renewed"] + self.lease["ttl"]

    def spawn(self) -> None:
        if os.path.exists(self.ready):
            os.unlink(self.ready)
        self.server = subprocess.Popen(  # same process group: `stop` signals both at once
            serve_argv(sys.executable, os.path.abspath(__file__), self.job, self.index, self.port,
                       self.ready),
            stdin=subprocess.DEVNULL, cwd=self.dir, close_fds=True, preexec_fn=die_with_parent)
        self.save(state="running", server_pid=self.server.pid,
                  server_ticks=proc_start_ticks(self.server.pid), server_started=time.time())

    def wait_server(self) -> int | None:
        """Wait until the server exits (its returncode) or the lease lapses (None)."""
        assert self.server is not None
        while True:
            try:
                return self.server.wait(timeout=SUPERVISE_POLL)
            except subprocess.TimeoutExpired:
                pass
            if self.lease_lapsed():
                return None

    def sleep(self, seconds: float) -> bool:
        """Sleep, unless stopped or the lease lapses first (False)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stopping or self.lease_lapsed():
                return False
            time.sleep(min(SUPERVISE_POLL, max(0.0, end - time.monotonic())))
        return not self.stopping

    def stop_server(self) -> None:
        if self.server is None or self.server.poll() is not None:
            return
        self.server.terminate()
        try:
            self.server.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        log_line(f"{self.name}: supervising its server on port {self.port} "
                 f"(restart limit {self.limit}, backoff {self.backoff:g}s)")
        quick_deaths = 0
        while not self.stopping:
            self.spawn()
            code = self.wait_server()
            if code is None:  # the lease lapsed
                break
            if self.stopping:
                break
            now = time.time()
            ran = now - self.state["server_started"]
            quick_deaths = 1 if ran >= STABLE_AFTER else quick_deaths + 1
            reason = exit_reason(code)
            self.save(state="restarting", last_exit=reason, server_pid=None, server_ticks=None)
            if self.state["restarts"] >= self.limit:
                log_line(f"{self.name}: server {reason} after {ran:.1f}s; restart limit "
                         f"({self.limit}) reached: giving up")
                self.save(state="failed")
                while self.sleep(3600):  # stay (server-less) until stopped or the lease lapses
                    pass
                break
            delay = min(self.backoff * 2 ** (quick_deaths - 1), RESTART_MAX_BACKOFF)
            log_line(f"{self.name}: server {reason} after {ran:.1f}s; restart "
                     f"{self.state['restarts'] + 1} of {self.limit} in {delay:g}s")
            if not self.sleep(delay):
                break
            self.save(restarts=self.state["restarts"] + 1)
        self.stop_server()
        if not self.stopping and self.lease_lapsed():
            self.expire()
        return 0

    def expire(self) -> None:
        """The lease lapsed: remove this task's files; the last task to go removes the root."""
        log_line(f"{self.name}: lease lapsed (ttl {self.lease['ttl']:g}s): stopping and cleaning up")
        import fcntl

        try:
            lock = open(os.path.join(self.root, ".expire-lock"), "a")
        except OSError:
            return  # already removed by another task
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one task at a time: the last one sees no others
            shutil.rmtree(self.dir, ignore_errors=True)
            if not running_tasks(self.root):
                shutil.rmtree(self.root, ignore_errors=True)


def cmd_supervise(args: argparse.Namespace) -> dict:
    job, index, port = parse_task(args.task[0], with_port=True)
    Supervisor(args.dir, job, index, port, args.restart_limit, args.restart_backoff).run()
    return {}


def cmd_serve(args: argparse.Namespace) -> dict:
    import tensorflow as tf

    # A cluster spec holding only this task is enough: the coordinator sends its own cluster
    # definition to every task when it connects (FACTS.md).
    cluster = tf.train.ClusterSpec({args.job: {args.index: f"localhost:{args.port}"}})
    server = tf.distribute.Server(cluster, job_name=args.job, task_index=args.index,
                                  protocol="grpc", start=True)
    write_json(args.ready, {"pid": os.getpid(), "target": server.target, "time": time.time()})
    print(f"dtf: {args.job}:{args.index} serving on port {args.port}", flush=True)
    server.join()  # never returns; SIGTERM's default action ends the process
    return {}


def task_status(root: str, job: str, index: int) -> dict:
    tdir = task_dir(root, job, index)
    record = read_json(os.path.join(tdir, "pid.json"))
    if record is None:
        return {"alive": False, "pid": None, "uptime": None, "reason": "never started"}
    sup = read_json(os.path.join(tdir, "supervisor.json")) or {}
    alive = ours(record)  # the supervisor
    server_alive = alive and ours(server_record(sup))
    port = record.get("port")
    state = sup.get("state", "starting") if alive else "dead"
    reason = None
    if state == "failed":
        reason = f"gave up after {sup.get('restarts')} restart(s); last exit: {sup.get('last_exit')}"
    elif not alive:
        reason = "supervisor is gone"
    return {
        "alive": bool(alive),
        "state": state,  # starting, running, restarting, failed, dead
        "pid": record["pid"],
        "server_pid": sup.get("server_pid") if server_alive else None,
        "uptime": round(time.time() - sup["server_started"], 1) if server_alive else None,
        "serving": bool(server_alive and port and port_open(port)),
        "restarts": sup.get("restarts", 0),
        "last_exit": sup.get("last_exit"),
        "reason": reason,
    }


def cmd_status(args: argparse.Namespace) -> dict:
    lease = renew(args.dir, None) if args.renew else read_json(lease_path(args.dir))
    return {"tasks": {t: task_status(args.dir, *parse_task(t, False)) for t in args.task},
            "lease": lease}


def renew(root: str, ttl: float | None) -> dict | None:
    """Renew the lease, keeping its ttl unless one is given; None if the cluster's files are gone
    (a lapsed lease removed them: renewing must not bring an empty directory back)."""
    if not os.path.isdir(root):
        return None
    old = read_json(lease_path(root)) or {}
    return write_lease(root, old.get("ttl", 0) if ttl is None else ttl)


def cmd_renew(args: argparse.Namespace) -> dict:
    lease = renew(args.dir, args.ttl)
    return {"lease": lease, "gone": lease is None}


def cmd_stop(args: argparse.Namespace) -> dict:
    # Per running task: its process group (the supervisor's pid) and the processes to see gone,
    # supervisor and server.
    groups: dict[str, tuple[int, list[dict]]] = {}
    for t in args.task:
        tdir = task_dir(args.dir, *parse_task(t, with_port=False))
        record = read_json(os.path.join(tdir, "pid.json"))
        server = server_record(read_json(os.path.join(tdir, "supervisor.json")) or {})
        members = [r for r in (record, server) if ours(r)]
        if record and members:
            groups[t] = (record["pid"], members)
    results = {t: {"was_running": t in groups, "killed": False} for t in args.task}

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
            time.sleep(0.05)

    for t in groups:
        signal_group(t, signal.SIGTERM)
    wait(args.grace)
    for t in groups:
        if alive(t):
            signal_group(t, signal.SIGKILL)
            results[t]["killed"] = True
    wait(5)
    for t in groups:
        results[t]["gone"] = not alive(t)
    return {"tasks": results}


def cmd_clean(args: argparse.Namespace) -> dict:
    removed = []
    if not os.path.isdir(args.dir):
        return {"removed": removed}
    if args.if_unused and running_tasks(args.dir):
        return {"removed": removed, "in_use": True}  # another dtf's tasks live here: not ours
    for name in sorted(os.listdir(args.dir)):
        path = os.path.join(args.dir, name)
        if os.path.isdir(path):
            if ours(read_json(os.path.join(path, "pid.json"))):
                raise SystemExit(f"refusing to clean {path}: its server is still running")
            for entry in os.listdir(path):
                if args.keep_logs and entry == "log":
                    continue
                target = os.path.join(path, entry)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)  # written by the server (a relative path in a program)
                else:
                    os.unlink(target)
                removed.append(target)
            if not os.listdir(path):
                os.rmdir(path)
    for name in ("launcher.py", "lease.json", ".expire-lock"):
        path = os.path.join(args.dir, name)
        if os.path.exists(path):
            os.unlink(path)
            removed.append(path)
    shutil.rmtree(os.path.join(args.dir, "__pycache__"), ignore_errors=True)
    if not os.listdir(args.dir):
        os.rmdir(args.dir)
    return {"removed": removed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("--dir")
    p.add_argument("--port", type=int, action="append", default=[])
    p = sub.add_parser("start")
    p.add_argument("--dir", required=True)
    p.add_argument("--task", action="append", default=[])
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--ttl", type=float, default=0.0)
    p.add_argument("--restart-limit", type=int, default=10)
    p.add_argument("--restart-backoff", type=float, default=0.5)
    p = sub.add_parser("supervise")
    p.add_argument("--dir", required=True)
    p.add_argument("--task", action="append", required=True)
    p.add_argument("--restart-limit", type=int, default=10)
    p.add_argument("--restart-backoff", type=float, default=0.5)
    p = sub.add_parser("renew")
    p.add_argument("--dir", required=True)
    p.add_argument("--ttl", type=float, default=None)
    p = sub.add_parser("serve")
    p.add_argument("--job", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ready", required=True)
    for name in ("status", "stop"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--task", action="append", default=[])
        p.add_argument("--grace", type=float, default=10.0)
        p.add_argument("--renew", action="store_true")
    p = sub.add_parser("clean")
    p.add_argument("--dir", required=True)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--if-unused", action="store_true")
    args = parser.parse_args(argv)
    if getattr(args, "dir", None):
        args.dir = os.path.expanduser(args.dir)
    if getattr(args, "ready", None):
        args.ready = os.path.expanduser(args.ready)
    handler = {"check": cmd_check, "start": cmd_start, "supervise": cmd_supervise, "serve": cmd_serve,
               "status": cmd_status, "renew": cmd_renew, "stop": cmd_stop, "clean": cmd_clean}[args.command]
    result = handler(args)
    if args.command == "supervise":
        return 0
    print(json.dumps(result), flush=True)
    if args.command == "start":
        return 0 if all(r["ok"] for r in result["tasks"].values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
