"""What `dtf up`, `dtf status` and `dtf down` cost at scale, on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/scale.py [--hosts 3,10,30,100] [--repeat 1] [--json FILE]
                                         [--bastion] [--profile] [--kex ALG]
    sudo .venv/bin/python bench/scale.py --tf [--repeat 3] [--json FILE]

The lab's hosts share this machine's cores, so its wall time pays each host's CPU once per host,
which a real cluster never does: each host spends it on its own cores, at the same time as the
others. What grows with the hosts on a real cluster is the laptop's CPU. So, for each host count
N (one lab of the largest N; a cluster of one task per host on the first N, h0 the ps, fake
servers: no TensorFlow), three figures per command, against the floor's (one
`ssh HOST PYTHON -c pass` per host, all at once; PYTHON is the hosts' python, the one dtf runs
its launcher and servers on):

1. the laptop's CPU per host: dtf's and every process it starts (ssh clients and their control
   masters, which fork and stay in dtf's control group); goals at 30 and 100 hosts: `up` within
   1.2x the floor's, `status` and `down` within 0.25x;
2. a host's CPU: what each lab host's sshd and everything it starts (the launcher, the supervisor,
   the fake server) spent during the command, each host's sshd in a control group of its own;
   budgets per host: 150 ms for `up`, 100 ms for `status` and for `down`;
3. the wall time, without a goal (see above).

With `--tf`: 3 hosts with TensorFlow servers; `up` against the lean floor (ssh and the server's
own `import tensorflow` on each host, all at once), goal within 1.3x; `status` and `down`, goal
0.5 s each.

The lab's hosts run commands as a lean host does: tests/lab.py keeps this machine's ~/.bashrc out
of their SSH sessions. The script runs under dtf as a user installs it (common.as_installed).
With `--repeat` 2 or more, each figure is the median, and the first `up` of each inventory and
the others are apart. With `--bastion`, every host is reached through one ProxyJump host with
OpenSSH's default MaxStartups (the floor goes straight to the hosts; the one through the bastion
is printed too).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, as_installed  # (puts tests/ on the path)
from cpugroups import CpuGroup, CpuGroups
from lab import Lab

COMMANDS = ("up", "status", "down")
LAPTOP_GOAL = {"up": 1.2, "status": 0.25, "down": 0.25}  # x the floor's laptop CPU
GOAL_COUNTS = (30, 100)  # the host counts the laptop goals are for
HOST_BUDGET_MS = {"up": 150, "status": 100, "down": 100}  # per host, per command
TF_UP_GOAL = 1.3  # x the lean floor's wall time
TF_WALL_GOAL_S = {"status": 0.5, "down": 0.5}
LEAN_IMPORT = (f"import sys; sys.path.insert(0, {str(REPO / 'server')!r}); "
               "from dtf_server.tfserve import server_lib; server_lib()")


class Failed(Exception):
    pass


@dataclass
class Figure:
    """One run of one command on N hosts."""

    wall_s: float
    laptop_s: float  # CPU of the laptop's processes
    hosts_s: list[float]  # CPU of each host's processes

    def laptop_ms_per_host(self) -> float:
        return 1000 * self.laptop_s / len(self.hosts_s)

    def host_ms(self) -> float:
        """The median host's CPU."""
        return 1000 * statistics.median(self.hosts_s)

    def host_max_ms(self) -> float:
        return 1000 * max(self.hosts_s)


class Meter:
    """The laptop's control group (every command measured starts in it) and one per lab host
    (its sshd moved there: each SSH session and what it starts is born in it)."""

    def __init__(self, groups: CpuGroups, lab: Lab) -> None:
        self.lab = lab
        self.laptop = groups.make("laptop")
        self.hosts: dict[str, CpuGroup] = {}
        for h in lab.hosts:
            assert h.proc is not None
            self.hosts[h.name] = groups.make(h.name)
            self.hosts[h.name].add(h.proc.pid)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """A process of the laptop's, born in its group (and so everything it starts)."""
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, text=True, preexec_fn=self.laptop.join,
                                **kwargs)

    def measure(self, hosts: Sequence[str], run: Callable[[], object]) -> Figure:
        laptop0 = self.laptop.usage_ns()
        hosts0 = [self.hosts[h].usage_ns() for h in hosts]
        t0 = time.monotonic()
        run()
        wall = time.monotonic() - t0
        return Figure(wall, (self.laptop.usage_ns() - laptop0) / 1e9,
                      [(self.hosts[h].usage_ns() - b) / 1e9 for h, b in zip(hosts, hosts0)])

    def check_apart(self) -> None:
        """The hosts' sshds (and so their sessions) are in their own groups, none in the laptop's."""
        for name, group in self.hosts.items():
            proc = self.lab.host(name).proc
            assert proc is not None
            if not group.holds(proc.pid):
                raise SystemExit(f"{name}'s sshd left its control group")
        for pid in self.laptop.pids():
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("sshd"):
                raise SystemExit(f"an sshd (pid {pid}) is in the laptop's control group")


def floor(meter: Meter, hosts: Sequence[str], code: str = "pass", *options: str,
          failed: list[str] | None = None) -> Figure:
    """One `ssh HOST PYTHON -c CODE` per host, all started at once (PYTHON: the hosts' python,
    the inventory's). ssh hands the remote shell one line: the code is quoted for it. A host that
    fails ends the benchmark, unless `failed` is given: its failures are added there."""
    tolerated = failed is not None
    lab = meter.lab
    failed = [] if failed is None else failed

    def run() -> None:
        procs = [meter.popen(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes",
                              *options, h, sys.executable, "-c", shlex.quote(code)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in hosts]
        for h, p in zip(hosts, procs):
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                failed.append(f"{h}: {err.strip()[-200:]}")

    figure = meter.measure(hosts, run)
    if failed and not tolerated:
        raise SystemExit(f"the floor failed on {len(failed)} host(s): {failed[0]}")
    return figure


def dtf_env(home: Path, fake: bool) -> dict[str, str]:
    return {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", **({"DTF_SERVER": "fake"} if fake else {})}


def dtf(meter: Meter, hosts: Sequence[str], args: Sequence[str], home: Path, fake: bool = True) -> Figure:
    """`dtf ARGS`, measured; Failed (with dtf's first lines) if it failed."""
    out: list[tuple[int, str]] = []

    def run() -> None:
        p = meter.popen([sys.executable, "-m", "dtf", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=dtf_env(home, fake), cwd=REPO)
        _, err = p.communicate(timeout=900)
        out.append((p.returncode, err))

    figure = meter.measure(hosts, run)
    code, err = out[0]
    if code != 0:
        lines = err.strip().splitlines()
        lines = lines[next((i for i, s in enumerate(lines) if s.startswith("dtf: error")), 0):]
        kinds = collections.Counter(re.sub(r"\d+", "N", line.split(": ", 1)[-1])[:70] for line in lines[1:])
        raise Failed(f"dtf {args[0]} failed after {figure.wall_s:.1f}s: {lines[0] if lines else ''} "
                     + "; ".join(f"{n} x {kind}" for kind, n in kinds.most_common(4)))
    return figure


def profiled_up(meter: Meter, hosts: Sequence[str], inv: Path, home: Path) -> Figure:
    """`dtf up` with its per-host progress lines (stderr, one line per step off a terminal) timed as
    they come: prints where the wall time went (the CLI's start, each step's median and slowest
    host, the end after the last host)."""
    seen: list[tuple[float, str, str]] = []  # (seconds since the start, host, step)
    codes: list[int] = []

    def run() -> None:
        t0 = time.monotonic()
        proc = meter.popen([sys.executable, "-m", "dtf", "up", str(inv)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=dtf_env(home, True), cwd=REPO)
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.match(r"^  (\S+): (.*)$", line.rstrip("\n"))
            if m:
                seen.append((time.monotonic() - t0, m.group(1), m.group(2)))
        codes.append(proc.wait())

    figure = meter.measure(hosts, run)
    total = figure.wall_s
    if codes[0] != 0:
        raise Failed(f"dtf up failed after {total:.1f}s")
    spans: dict[str, list[float]] = collections.defaultdict(list)
    last: dict[str, tuple[float, str]] = {}
    for at, host, step in seen:
        if host in last:
            began, what = last[host]
            spans[re.sub(r"\d+", "N", what)].append(at - began)
        last[host] = (at, step)
    first = min((at for at, _, _ in seen), default=total)
    done = max((at for at, _, _ in seen), default=total)
    print(f"    up {total:.2f} s: first progress line at {first:.2f} s (the CLI's start and plan), "
          f"last at {done:.2f} s, exit {total - done:.2f} s after it", flush=True)
    for what, xs in spans.items():
        print(f"    {what[:70]:70s} n={len(xs):3d} median {statistics.median(xs):6.2f} s  max {max(xs):6.2f} s",
              flush=True)
    return figure


@dataclass
class Row:
    """The figures of one host count: each key's runs."""

    hosts: int
    runs: dict[str, list[Figure]] = field(default_factory=lambda: collections.defaultdict(list))

    def median(self, key: str, of: Callable[[Figure], float]) -> float | None:
        return statistics.median(of(f) for f in self.runs[key]) if self.runs.get(key) else None


def fake_counts(meter: Meter, names: list[str], counts: list[int], args: argparse.Namespace,
                tmp: Path) -> list[Row]:
    lab = meter.lab
    home = tmp / "home"
    ports = lab.ports(1)
    rows = []
    for n in counts:
        hosts = names[:n]
        inv = lab.inventory(tmp / f"n{n}.yaml", [{"host": h, **({"ps": ports} if i == 0 else {"workers": ports})}
                                                 for i, h in enumerate(hosts)], cluster=f"scale{n}")
        row = Row(n)
        for i in range(args.repeat):
            if args.bastion:
                # (the bastion's sshd drops connections beyond MaxStartups: ssh's own ProxyJump fails
                # on some hosts, which is said, not an end of the benchmark)
                dropped: list[str] = []
                through = floor(meter, hosts, failed=dropped)
                print(f"  floor through the bastion (ssh's own ProxyJump), {n} hosts: {through.wall_s:.2f} s, "
                      f"{len(dropped)} failed", flush=True)
            row.runs["floor"].append(floor(meter, hosts, "pass", "-o", "ProxyJump=none"))
            try:
                for what in COMMANDS:
                    if what == "up" and args.profile:
                        figure = profiled_up(meter, hosts, inv, home)
                    else:
                        figure = dtf(meter, hosts, ["up", str(inv)] if what == "up" else [what], home)
                    row.runs["up again" if what == "up" and i else what].append(figure)
                    if what == "up":
                        meter.check_apart()  # with the masters and the servers running
            except Failed as e:
                print(f"  {n} hosts: {e}", flush=True)
                subprocess.run([sys.executable, "-m", "dtf", "down"], env=dtf_env(home, True), cwd=REPO,
                               capture_output=True, timeout=900)  # whatever is left
        rows.append(row)
        print(f"  {n} hosts done (load {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{k} {row.median(k, Figure.laptop_ms_per_host):.1f} ms/host of the laptop's CPU" for k in row.runs),
              flush=True)
    return rows


def ms(value: float | None, floor: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} ms" + (f" ({value / floor:.2f}x)" if floor else "")


def laptop_goals(rows: list[Row]) -> list[dict[str, object]]:
    out = []
    for row in rows:
        base = row.median("floor", Figure.laptop_ms_per_host)
        for what in COMMANDS:
            value = row.median(what, Figure.laptop_ms_per_host)
            if row.hosts in GOAL_COUNTS and value is not None and base:
                out.append({"hosts": row.hosts, "command": what, "ratio": value / base,
                            "goal": LAPTOP_GOAL[what], "met": value / base <= LAPTOP_GOAL[what]})
    return out


def host_goals(rows: list[Row]) -> list[dict[str, object]]:
    out = []
    for row in rows:
        for what in COMMANDS:
            value = row.median(what, Figure.host_ms)
            if value is not None:
                out.append({"hosts": row.hosts, "command": what, "ms": value,
                            "budget_ms": HOST_BUDGET_MS[what], "met": value <= HOST_BUDGET_MS[what]})
    return out


def print_fake(rows: list[Row], cores: int | None) -> None:
    print("\nThe laptop's CPU per host (dtf and every ssh process it starts), x the floor's:\n"
          "| hosts | floor | `dtf up` | `dtf up` (again) | `dtf status` | `dtf down` |\n|---|---|---|---|---|---|")
    for row in rows:
        base = row.median("floor", Figure.laptop_ms_per_host)
        print(f"| {row.hosts} | {ms(base)} | " + " | ".join(
            ms(row.median(k, Figure.laptop_ms_per_host), base) for k in ("up", "up again", "status", "down")) + " |")
    for g in laptop_goals(rows):
        print(f"  {g['hosts']} hosts, {g['command']}: {g['ratio']:.2f}x the floor (goal <= {g['goal']}x): {met(g)}")

    print("\nA host's CPU per command (its sshd's sessions: launcher, supervisor, fake server), "
          "median host (slowest):\n"
          "| hosts | floor | `dtf up` | `dtf status` | `dtf down` |\n|---|---|---|---|---|")
    for row in rows:
        cells = [f"{ms(row.median(k, Figure.host_ms))} ({ms(row.median(k, Figure.host_max_ms))})"
                 if row.runs.get(k) else "-" for k in ("floor", *COMMANDS)]
        print(f"| {row.hosts} | " + " | ".join(cells) + " |")
    for g in host_goals(rows):
        print(f"  {g['hosts']} hosts, {g['command']}: {g['ms']:.1f} ms a host (budget {g['budget_ms']} ms): {met(g)}")

    print(f"\nWall time on the lab, x the floor's (no goal: the lab's hosts share this machine's {cores} "
          "cores, so a host's CPU counts once per host here, which a real cluster never pays):\n"
          "| hosts | floor | `dtf up` | `dtf up` (again) | `dtf status` | `dtf down` |\n|---|---|---|---|---|---|")
    for row in rows:
        base = row.median("floor", lambda f: f.wall_s)
        cells = [f"{v:.2f} s ({v / base:.2f}x)" if (v := row.median(k, lambda f: f.wall_s)) is not None and base
                 else "-" for k in ("up", "up again", "status", "down")]
        print(f"| {row.hosts} | {base:.2f} s | " + " | ".join(cells) + " |")


def summary(figures: list[Figure]) -> dict[str, float]:
    return {"wall_s": statistics.median(f.wall_s for f in figures),
            "laptop_cpu_ms_per_host": statistics.median(f.laptop_ms_per_host() for f in figures),
            "host_cpu_ms": statistics.median(f.host_ms() for f in figures),
            "host_cpu_ms_max": statistics.median(f.host_max_ms() for f in figures),
            "runs": len(figures)}


def tf_hosts(meter: Meter, names: list[str], repeat: int, tmp: Path) -> dict[str, list[Figure]]:
    """3 hosts, TensorFlow servers: the lean floor, then `up`, `status`, `down`, `repeat` times."""
    lab, hosts, home = meter.lab, names[:3], tmp / "home"
    ports = lab.ports(1)
    inv = lab.inventory(tmp / "tf.yaml", [{"host": h, **({"ps": ports} if i == 0 else {"workers": ports})}
                                          for i, h in enumerate(hosts)], cluster="scaletf")
    runs: dict[str, list[Figure]] = collections.defaultdict(list)
    for _ in range(repeat):
        runs["lean floor"].append(floor(meter, hosts, LEAN_IMPORT, "-o", "ProxyJump=none"))
        try:
            for what in COMMANDS:
                runs[what].append(dtf(meter, hosts, ["up", str(inv)] if what == "up" else [what], home, fake=False))
        except Failed as e:
            print(f"  TensorFlow hosts: {e}", flush=True)
            subprocess.run([sys.executable, "-m", "dtf", "down"], env=dtf_env(home, False), cwd=REPO,
                           capture_output=True, timeout=900)
        print("  " + ", ".join(f"{k} {v[-1].wall_s:.2f} s" for k, v in runs.items()), flush=True)
    return runs


def tf_goals(runs: dict[str, list[Figure]]) -> list[dict[str, object]]:
    walls = {k: statistics.median(f.wall_s for f in v) for k, v in runs.items() if v}
    out: list[dict[str, object]] = []
    if "up" in walls:
        ratio = walls["up"] / walls["lean floor"]
        out.append({"command": "up", "ratio": ratio, "goal": TF_UP_GOAL, "met": ratio <= TF_UP_GOAL})
    for what, goal in TF_WALL_GOAL_S.items():
        if what in walls:
            out.append({"command": what, "wall_s": walls[what], "goal_s": goal, "met": walls[what] <= goal})
    return out


def met(goal: dict[str, object]) -> str:
    return "met" if goal["met"] else "NOT met"


def print_tf(runs: dict[str, list[Figure]]) -> None:
    print("\n3 TensorFlow hosts: wall time, the laptop's CPU per host, a host's CPU (median host):\n"
          "| | wall | laptop CPU per host | a host's CPU |\n|---|---|---|---|")
    for key, figures in runs.items():
        s = summary(figures)
        print(f"| {key} | {s['wall_s']:.2f} s | {s['laptop_cpu_ms_per_host']:.1f} ms | {s['host_cpu_ms']:.1f} ms |")
    for g in tf_goals(runs):
        if "ratio" in g:
            print(f"  up: {g['ratio']:.2f}x the lean floor (goal <= {g['goal']}x): {met(g)}")
        else:
            print(f"  {g['command']}: {g['wall_s']:.2f} s (goal <= {g['goal_s']} s): {met(g)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="3,10,30,100", help="host counts, comma-separated")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tf", action="store_true", help="3 hosts with TensorFlow servers instead of the fake counts")
    ap.add_argument("--json", type=Path, help="also write the figures to this file, as JSON")
    ap.add_argument("--bastion", action="store_true", help="every host behind one ProxyJump host")
    ap.add_argument("--profile", action="store_true", help="print where `up`'s wall time went, per step")
    ap.add_argument("--kex", help="a KexAlgorithms for every host in the lab's ssh_config: the floor's and dtf's "
                                  "(bench/ssh_kex.py: OpenSSH 9.0-9.8's default costs the client ~100 ms a handshake)")
    args = ap.parse_args()
    counts = [3] if args.tf else [int(n) for n in args.hosts.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench/scale.py needs root: the SSH lab and the control groups it measures in")
    extra = 1 if args.bastion else 0
    with tempfile.TemporaryDirectory() as tmp, Lab(max(counts) + extra, root=Path(tmp) / "lab",
                                                   bastion=args.bastion) as lab, CpuGroups() as groups:
        if args.kex:
            with open(lab.ssh_config, "a") as config:
                config.write(f"\nHost *\n  KexAlgorithms {args.kex}\n")
        meter = Meter(groups, lab)
        names = [h.name for h in lab.hosts if h.name != lab.bastion_name]
        info = {"hosts": len(names), "bastion": args.bastion, "mode": lab.mode, "cores": os.cpu_count(),
                "cgroup": "v1 cpuacct" if groups.v1 else "v2", "kex": args.kex, "python": sys.executable}
        print(f"lab: {len(names)} hosts{' behind bastion ' + str(lab.bastion_name) if args.bastion else ''}, "
              f"mode {lab.mode}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, CPU by cgroup "
              f"{info['cgroup']}" + (f", KexAlgorithms {args.kex}" if args.kex else ""), flush=True)
        result: dict[str, object] = {"lab": info}
        if args.tf:
            runs = tf_hosts(meter, names, args.repeat, Path(tmp))
            print_tf(runs)
            result["tf"] = {"figures": {k: summary(v) for k, v in runs.items() if v}, "goals": tf_goals(runs)}
        else:
            rows = fake_counts(meter, names, counts, args, Path(tmp))
            print_fake(rows, os.cpu_count())
            result["counts"] = [{"hosts": r.hosts, **{k: summary(v) for k, v in r.runs.items() if v}} for r in rows]
            result["goals"] = {"laptop": laptop_goals(rows), "host": host_goals(rows)}
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
            print(f"\n(figures written to {args.json})")


if __name__ == "__main__":
    as_installed()
    main()
