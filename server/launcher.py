#!/usr/bin/env python3
"""dtf's launcher: the one file dtf uploads to each host. Standard library plus TensorFlow only.

It never imports the dtf client, so a host needs nothing but a python with TensorFlow.
Every subcommand prints one JSON document on stdout and exits 0 when it did what was asked.

    check  --port P ...                      versions, busy ports, the SSH client's address
    start  --dir D --task JOB:INDEX:PORT ... start servers detached, wait until each serves
    serve  --job J --index I --port P --ready F   (internal) run one tf.distribute.Server
    status --dir D --task JOB:INDEX ...      is each task alive, since when
    stop   --dir D --task JOB:INDEX ...      TERM the task's process group, KILL after a grace
    clean  --dir D [--keep-logs]             remove what dtf put in D

Files of a task live in D/JOB-INDEX/: `log` (the server's stdout and stderr), `pid.json` (pid,
process start time: a pid is only ever signalled if its start time still matches, so dtf never
kills a process it did not start), `ready.json` (written by the server once it serves).
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


def boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


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
    }


def cmd_start(args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in args.env)
    launcher = os.path.abspath(__file__)
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
        ready = os.path.join(tdir, "ready.json")
        if os.path.exists(ready):  # left by an earlier run: must not count as this one's signal
            os.unlink(ready)
        log = open(os.path.join(tdir, "log"), "ab")
        proc = subprocess.Popen(
            serve_argv(sys.executable, launcher, job, index, port, ready),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tdir,
            start_new_session=True,  # its own session: survives the SSH session, one group to kill
            close_fds=True,
        )
        log.close()
        record = {"pid": proc.pid, "start_ticks": proc_start_ticks(proc.pid), "job": job,
                  "index": index, "port": port, "started": time.time()}
        write_json(os.path.join(tdir, "pid.json"), record)
        started[name] = {"pid": proc.pid, "already": False, "port": port, "dir": tdir,
                         "proc": proc, "ready": ready}

    # Ready means: the server wrote ready.json after tf.distribute.Server started, AND its port
    # accepts a connection. A server that exits first has crashed: report its log's last lines.
    deadline = time.monotonic() + args.timeout
    results: dict[str, dict] = {}
    pending = {n: t for n, t in started.items() if not t["already"]}
    for n, t in started.items():
        if t["already"]:
            results[n] = {"ok": True, "pid": t["pid"], "already": True}
    while pending and time.monotonic() < deadline:
        for n, t in list(pending.items()):
            code = t["proc"].poll()
            if code is not None:
                results[n] = {"ok": False, "pid": t["pid"], "reason": f"server exited with code {code}",
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


def task_status(root: str, job: str, index: int, btime: float, tick: int) -> dict:
    record = read_json(os.path.join(task_dir(root, job, index), "pid.json"))
    if record is None:
        return {"alive": False, "pid": None, "uptime": None, "reason": "never started"}
    alive = ours(record)
    port = record.get("port")
    return {
        "alive": alive,
        "pid": record["pid"],
        "uptime": round(time.time() - (btime + record["start_ticks"] / tick), 1) if alive else None,
        "serving": bool(alive and port and port_open(port)),
    }


def cmd_status(args: argparse.Namespace) -> dict:
    btime, tick = boot_time(), os.sysconf("SC_CLK_TCK")
    return {"tasks": {t: task_status(args.dir, *parse_task(t, False), btime, tick) for t in args.task}}


def cmd_stop(args: argparse.Namespace) -> dict:
    records = {}
    for t in args.task:
        job, index = parse_task(t, with_port=False)
        record = read_json(os.path.join(task_dir(args.dir, job, index), "pid.json"))
        if ours(record):
            records[t] = record
    results = {t: {"was_running": t in records, "killed": False} for t in args.task}

    def signal_group(record: dict, sig: int) -> None:
        if not ours(record):
            return
        try:
            os.killpg(record["pid"], sig)  # the server leads its own session and group
        except ProcessLookupError:
            pass

    for record in records.values():
        signal_group(record, signal.SIGTERM)
    deadline = time.monotonic() + args.grace
    while any(ours(r) for r in records.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for t, record in records.items():
        if ours(record):
            signal_group(record, signal.SIGKILL)
            results[t]["killed"] = True
    deadline = time.monotonic() + 5
    while any(ours(r) for r in records.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for t, record in records.items():
        results[t]["gone"] = not ours(record)
    return {"tasks": results}


def cmd_clean(args: argparse.Namespace) -> dict:
    removed = []
    if not os.path.isdir(args.dir):
        return {"removed": removed}
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
    launcher = os.path.join(args.dir, "launcher.py")
    if os.path.exists(launcher):
        os.unlink(launcher)
        removed.append(launcher)
    shutil.rmtree(os.path.join(args.dir, "__pycache__"), ignore_errors=True)
    if not os.listdir(args.dir):
        os.rmdir(args.dir)
    return {"removed": removed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("--port", type=int, action="append", default=[])
    p = sub.add_parser("start")
    p.add_argument("--dir", required=True)
    p.add_argument("--task", action="append", default=[])
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--timeout", type=float, default=60.0)
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
    p = sub.add_parser("clean")
    p.add_argument("--dir", required=True)
    p.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if getattr(args, "dir", None):
        args.dir = os.path.expanduser(args.dir)
    if getattr(args, "ready", None):
        args.ready = os.path.expanduser(args.ready)
    handler = {"check": cmd_check, "start": cmd_start, "serve": cmd_serve, "status": cmd_status,
               "stop": cmd_stop, "clean": cmd_clean}[args.command]
    result = handler(args)
    print(json.dumps(result), flush=True)
    if args.command == "start":
        return 0 if all(r["ok"] for r in result["tasks"].values()) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
