"""CPU a host spends on the launcher's everyday commands: prints a table against the budget.

    .venv/bin/python bench/host_cpu.py [-n 15] [--server DIR]

Each round runs, in a fresh python each, what `up`, `status` and `down` run on one host of a
one-task cluster with a fake server (no TensorFlow):
- up: `check-start` (the launcher's bytes on stdin, as `up` sends them: control's boot), which
  forks the task's supervisor, which forks its server, and waits until it serves; its CPU is
  the launcher's, plus the supervisor's and the server's until then;
- status: `status --renew`;
- down: `stop --clean`.
CPU is user + system: the launcher's from getrusage(RUSAGE_CHILDREN), the detached supervisor's
and server's from /proc/PID/schedstat (their time on a CPU), read before `down` ends them. The
pythons run without site (`-S`, as `status` and `down` run it: a host's .pth files are its own
cost, not dtf's), with a TensorFlow's metadata on their path for the check to find.

`--server DIR`: the `dtf_server` package to measure (default: this checkout's `server/`), so
another version's can be measured against the same budget.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client"))

from dtf.files import shipping  # noqa: E402  (its _build: the launcher as dtf makes it)
from dtf.hosts.control import _BOOT  # noqa: E402  (the boot `up` runs the launcher with)
from dtf.hosts.netutil import listen_ports  # noqa: E402

BUDGET_MS = {"up": 150.0, "status": 100.0, "down": 100.0}


def build_launcher(server: Path) -> bytes:
    """The `dtf_server` package in `server` as a zipapp, built by the code dtf ships it with
    (sources and their bytecode, whatever the directory's __pycache__ holds)."""
    sources = [(f"{path.relative_to(server).as_posix()}", path.read_bytes())
               for path in sorted((server / "dtf_server").rglob("*.py")) if "__pycache__" not in path.parts]
    return shipping._build(sources)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """Seconds process `pid` has run on a CPU so far (0.0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def run(python_args: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> tuple[float, str]:
    """The CPU of one python command (it and the children it waited for), and its stdout."""
    before = children_cpu()
    r = subprocess.run([sys.executable, "-S", *python_args], input=stdin, capture_output=True, env=env,
                       timeout=120)
    spent = children_cpu() - before
    if r.returncode != 0:
        sys.exit(f"{python_args[:3]} failed ({r.returncode}):\n{r.stderr.decode()[-2000:]}")
    return spent, r.stdout.decode()


def one_round(tmp: Path, data: bytes, env: dict[str, str]) -> dict[str, float]:
    launcher = tmp / "launcher.pyz"
    root = tmp / "cluster"
    (port,) = listen_ports(1)
    argv = [sys.executable, str(launcher), "fake", "--job", "worker", "--index", "0", "--port", str(port),
            "--ready", str(root / "worker-0" / "ready.json")]
    task = json.dumps({"job": "worker", "index": 0, "port": port, "argv": argv}, separators=(",", ":"))
    up, out = run(["-c", _BOOT, str(len(data)), str(launcher), f"{launcher}.tmp", "check-start",
                   "--dir", str(root), "--port", str(port), "--tensorflow", "", "--fresh", "--timeout", "30",
                   "--ttl", "600", "--task", task, "--reach", f"127.0.0.1:{port}", "--reach-timeout", "5"],
                  stdin=data, env=env)
    started = json.loads(out.splitlines()[-1])
    supervisor = started["tasks"]["worker:0"]["pid"]
    server = json.loads((root / "worker-0" / "supervisor.json").read_text())["server_pid"]
    up += process_cpu(supervisor) + process_cpu(server)
    status, out = run([str(launcher), "status", "--dir", str(root), "--renew", "--task", "worker:0"], env=env)
    if not json.loads(out)["tasks"]["worker:0"]["serving"]:
        sys.exit(f"the fake server does not serve: {out}")
    down, out = run([str(launcher), "stop", "--dir", str(root), "--grace", "10", "--task", "worker:0", "--clean"],
                    env=env)
    if root.exists():
        sys.exit(f"down left {root}: {out}")
    return {"up": up * 1000, "status": status * 1000, "down": down * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="rounds (the median is reported)")
    parser.add_argument("--server", type=Path, default=REPO / "server", help="the directory holding dtf_server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtf-host-cpu-") as name:
        tmp = Path(name)
        data = build_launcher(args.server.resolve())
        packages = tmp / "packages"
        (packages / "tensorflow-2.99.0.dist-info").mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(packages)}
        run(["-c", "pass"])  # (the interpreter's files in the page cache)
        rounds = [one_round(tmp, data, env) for _ in range(args.n)]
        floor = statistics.median(run(["-c", "pass"])[0] * 1000 for _ in range(args.n))
    print(f"dtf_server from {args.server}, python {sys.version.split()[0]}, {args.n} rounds")
    print(f"{'command':<8} {'median ms':>10} {'min':>7} {'max':>7} {'budget':>7}")
    over = []
    for command, budget in BUDGET_MS.items():
        figures = [r[command] for r in rounds]
        median = statistics.median(figures)
        print(f"{command:<8} {median:10.1f} {min(figures):7.1f} {max(figures):7.1f} {budget:7.0f}"
              f"{'  OVER' if median > budget else ''}")
        if median > budget:
            over.append(command)
    print(f"(python -S -c pass alone: {floor:.1f} ms)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
