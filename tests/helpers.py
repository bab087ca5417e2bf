"""Running the real `dtf` command in a subprocess, as a user would, for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtf.hosts.netutil import listen_ports

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
PROGRAMS = REPO / "tests" / "e2e" / "programs"
# Set by tests/conftest.py to the test run's own id, inherited by every process the run starts
# (dtf, and the ssh masters dtf starts): what tells them from another run's on the same machine.
RUN_MARK = "DTF_TEST_RUN"
NOISE = ("I0000 ", "W0000 ", "E0000 ", "WARNING: All log messages")


def as_in_a_terminal() -> None:
    """preexec_fn of a command the test will Ctrl-C: SIGINT and SIGQUIT back to their defaults,
    as in a terminal's foreground job. A test run started in the background by a shell without
    job control (`make test &` in a script) has them ignored, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def train_interrupted(home: Path, *args: str, timeout: float) -> tuple[int, str, str]:
    """`dtf train ARGS` in a session of its own, like a terminal's foreground job, Ctrl-C'd (SIGINT
    to the whole group) once the program prints its first line, `training`: (exit code, the rest of
    its stdout, its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "train", *args],
                            env={**os.environ, "DTF_HOME": str(home)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "training"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def dtf(*args: str, home: Path, timeout: float = 300, env: dict | None = None,
        cwd: Path | None = None, check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `dtf ARGS` with DTF_HOME=home; never hangs (timeout). `check`: a failure ends the
    caller (a benchmark) with dtf's output."""
    full_env = {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", **(env or {})}
    r = subprocess.run([sys.executable, "-m", "dtf", *args], capture_output=True, text=True,
                       timeout=timeout, env=full_env, cwd=cwd or REPO, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise SystemExit(f"failed: dtf {' '.join(args)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def down_recorded(where: Path) -> None:
    """`dtf down` every cluster recorded under `where` (any DTF_HOME below it: `home/state/NAME.json`):
    what a test left up when an assertion failed before its own `down`."""
    for records in sorted(where.glob("**/state")):
        for record in sorted(records.glob("*.json")):
            dtf("down", "-c", record.stem, home=records.parent, timeout=120)


def status_json(home: Path) -> dict:
    r = dtf("status", "--json", home=home, timeout=60)
    return json.loads(r.stdout)


def assert_one_line_error(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command failed with `code`, said why on stderr, and showed no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.startswith("dtf: error:") or "dtf: error:" in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
    return r.stderr


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Until none of `pids` is alive (a SIGKILL has landed): a fault is in place before the test
    lets the program go on."""
    deadline = time.monotonic() + timeout
    while alive := pids_alive(pids):
        assert time.monotonic() < deadline, f"still alive {timeout}s after being killed: {alive}"
        time.sleep(0.02)


def server_process(pid: int, cmd: str, command: str = "fake") -> bool:
    """Whether the process is a server of that launcher command (`fake`, `serve`): one of its own
    (its command line says so), or one forked from its supervisor (dtf_server.supervisor.fork_server:
    the supervisor's command line), which its comm names ("fake ps:0")."""
    if f" {command} " in f"{cmd} ":
        return True
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith(f"{command} ")
    except OSError:
        return False


def fake_server(pid: int, cmd: str) -> bool:
    return server_process(pid, cmd, "fake")


def wait_until(what, timeout: float = 20.0, every: float = 0.1):
    """what()'s first true value, polled until `timeout` (then the test fails)."""
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, f"not true after {timeout}s"
        time.sleep(every)
    return value


def within(timeout: float, what):
    """what()'s answer (or its exception), which must come within `timeout` seconds, else the test
    fails: the generous deadline of a call that a fault would make hang. A daemon thread runs it,
    so a call that hangs does not hold the test run's exit."""
    box: list = []
    done = threading.Event()

    def call() -> None:
        try:
            box.append((True, what()))
        except BaseException as e:  # (handed to the test's own thread)
            box.append((False, e))
        finally:
            done.set()

    threading.Thread(target=call, name="within", daemon=True).start()
    if not done.wait(timeout):
        pytest.fail(f"no answer within {timeout:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def leftovers(lab) -> dict[str, list]:
    """Processes still running from any lab host's dtf workdir (one look at /proc for all hosts)."""
    return {name: p for name, p in lab.processes_of_hosts().items() if p}


def epochs_done(text: str) -> list[tuple[int, int]]:
    """(epoch, attempt) of every "epoch E/N done: ... (attempt A)" line, in order."""
    return [(int(e), int(a)) for e, a in re.findall(r"^epoch (\d+)/\d+ done: .*\(attempt (\d+)\)$", text, re.M)]


# What dtf itself keeps in a cluster's directory on a host (its tasks' directories included).
DTF_FILES = frozenset({"log", "pid.json", "ready.json", "supervisor.json", "lease.json", "firewall.json"})


def saved_on_hosts(lab, cluster: str) -> list[str]:
    """Every file in the cluster's directory on the lab's hosts that is not dtf's own: what a
    program saved there instead of on this machine. First, until `dtf train`'s repair has
    stopped following the hosts (its `top` streams end, and their records with them, once their
    SSH channels closed)."""
    from dtf.files.shipping import launcher_name

    wait_until(lambda: not [p for h in lab.hosts for p in Path(h.workdir, cluster).glob("top-*.json")], timeout=30)
    return [str(p) for h in lab.hosts for p in Path(h.workdir, cluster).rglob("*")
            if p.is_file() and p.name not in DTF_FILES | {launcher_name()}]


def stop_train(proc: subprocess.Popen, timeout: float = 60) -> None:
    """End a `dtf train` still running at a test's end as SIGTERM does: it stops its program first
    (a SIGKILL would end dtf alone, and leave the program running)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from one look at /proc (a child in a session of its own
    included: a laptop asleep stops them all)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[list[int]]:
    """Every process of the tree under `pid` stopped (SIGSTOP) while inside, as a laptop that
    sleeps stops them, then continued (SIGCONT), also when the caller fails: the processes stopped."""
    tree = process_tree(pid)
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGSTOP)
    try:
        yield tree
    finally:
        for p in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


class Train:
    """`dtf train ...` running in the background; stdout and stderr in one file, as a user sees."""

    def __init__(self, home: Path, out: Path, *args: str, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.path = out
        self.file = open(out, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtf.cli", "train", *args],
            env={**os.environ, **(env or {}), "DTF_HOME": str(home)}, stdout=self.file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=cwd, preexec_fn=as_in_a_terminal)

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120) -> float:
        """Wait until the output matches `pattern`; the time it did (time.monotonic())."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(), re.M):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} first:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout}s:\n{self.text()[-4000:]}"
            time.sleep(0.05)
        return time.monotonic()

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"dtf train still running after {timeout}s:\n{self.text()[-6000:]}") from None
        finally:
            stop_train(self.proc)
            self.file.close()
        return code, self.text()


class Barrier:
    """The test's side of tests/e2e/programs/barrier.py: the program stops at the first line it
    prints that matches `pattern` until the test has put its fault in place, so that no fault test
    races the program (a fast machine finishing the training before the kill, say).

        barrier = Barrier(tmp_path / "barrier", r"^epoch 2/6 done")
        run = Train(home, out, *barrier.argv(EXAMPLES / "custom_loop.py", "--epochs", "6"))
        with barrier.held(run):
            kill_server(home, "ps:0")      # the program waits at "epoch 2/6 done" meanwhile
    """

    def __init__(self, where: Path, pattern: str, attempt: int = 1) -> None:
        """`attempt`: the run's attempt it holds in (its first, unless said)."""
        self.dir, self.pattern = where, pattern if attempt == 1 else f"@{attempt}:{pattern}"
        where.mkdir(parents=True, exist_ok=True)

    def argv(self, program: Path | str, *args: str, then: tuple[Barrier, ...] = ()) -> list[str]:
        """The command line for `dtf train`: barrier.py, this barrier and those `then`, PROGRAM
        ARGS (a relative PROGRAM is found next to barrier.py: copy both to the same directory)."""
        pairs = [str(x) for b in (self, *then) for x in (b.dir, b.pattern)]
        return [str(PROGRAMS / "barrier.py"), *pairs, "--", str(program), *args]

    def reached(self) -> list[str]:
        """The lines the program (each copy, in collective mode) is held at."""
        return [p.read_text().strip() for p in sorted(self.dir.glob("reached-*"))]

    def wait(self, run: Train, timeout: float = 600) -> str:
        """Until the program is held at the barrier: the line it is held at. A program that ends
        first, or never gets there, fails the test saying so."""
        deadline = time.monotonic() + timeout
        while not (lines := self.reached()):
            assert run.proc.poll() is None, (f"the program exited {run.proc.returncode} before it reached "
                                             f"{self.pattern!r}:\n{run.text()[-4000:]}")
            assert time.monotonic() < deadline, f"no {self.pattern!r} after {timeout}s:\n{run.text()[-4000:]}"
            time.sleep(0.05)
        return lines[0]

    def release(self) -> None:
        (self.dir / "release").write_text("")

    @contextlib.contextmanager
    def held(self, run: Train, timeout: float = 600) -> Iterator[str]:
        """Wait until the program is held, let the caller put its fault in place, then release it
        (also when the caller fails: the program is never left waiting)."""
        line = self.wait(run, timeout)
        try:
            yield line
        finally:
            self.release()


class Interruptible:
    """`dtf ARGS` in the background, in a process group of its own as a terminal runs it: wait
    for a line on its stderr, press Ctrl-C (SIGINT to the group), collect what it said."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "dtf", *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=as_in_a_terminal)
        self.seen = ""
        self.deadline = time.monotonic() + 120

    def wait_for(self, text: str) -> None:
        assert self.proc.stderr is not None
        while text not in self.seen:
            assert time.monotonic() < self.deadline and self.proc.poll() is None, self.seen
            self.seen += self.proc.stderr.readline()

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        """Its exit code and all it wrote on stderr. The rest of stderr is read through the same
        file object `wait_for` read from: `communicate` reads the pipe itself and would lose the
        lines already in that object's buffer (a rollback's per-host lines, its failures)."""
        out, err = self.proc.stdout, self.proc.stderr
        assert out is not None and err is not None
        rest: list[str] = []
        readers = [threading.Thread(target=out.read, daemon=True),
                   threading.Thread(target=lambda: rest.append(err.read()), daemon=True)]
        for r in readers:
            r.start()
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for r in readers:
                r.join(timeout=10)
        return self.proc.returncode, self.seen + "".join(rest)


def master_path(home: Path, cluster: str, host: str) -> str:
    """A control socket path for a master a test starts itself, below dtf-ssh- (ssh_processes
    counts the processes of such masters; the cluster's own masters, dtf.hosts.control's, live
    below dtf-ctl- for the cluster's life)."""
    import hashlib
    import tempfile

    key = hashlib.sha256(f"{home}\0{cluster}\0{host}".encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"dtf-ssh-{os.getuid()}" / key)


def ssh_processes() -> list[tuple[int, list[str]]]:
    """ssh masters and channels dtf started on this machine: their ControlPath is below dtf-ssh-
    (OpenSSH renames a master "ssh: PATH [mux]"). Only this test run's (RUN_MARK in their
    environment): another run testing at the same time has masters of its own."""
    mark = f"{RUN_MARK}={os.environ[RUN_MARK]}".encode() if RUN_MARK in os.environ else None
    out = []
    for pid in Path("/proc").iterdir():
        try:
            argv = (pid / "cmdline").read_bytes().decode().split("\0")
            if not ((Path(argv[0]).name == "ssh" or argv[0].startswith("ssh: ")) and any("dtf-ssh-" in a for a in argv)):
                continue
            if mark is not None and mark not in (pid / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, ValueError):
            continue
        out.append((int(pid.name), argv))
    return out


# The tests that only train on a local cluster (and leave it as they found it: each checks so)
# share one (the `local_cluster` fixture of tests/e2e/conftest.py): they are this xdist group, so
# one test process runs them all and starts its three TensorFlow servers once, not once per module.
LOCAL_CLUSTER = pytest.mark.xdist_group("local-cluster")


def write_local_inventory(where: Path) -> Path:
    """A local cluster `loc` (1 ps, 2 workers on free ports) working in WHERE/work."""
    ps, w0, w1 = listen_ports(3)  # not bind(0)'s: an outgoing connection may take those first
    path = where / "local.yaml"
    path.write_text(f"cluster: loc\nhosts:\n  - host: localhost\n    connection: local\n"
                    f"    workdir: {where / 'work'}\n    ps: [{ps}]\n    workers: [{w0}, {w1}]\n")
    return path


# A Slurm cluster's inventory and the record `dtf up` would make of it (job 77 on n1 and n2), for
# the tests that need one without a Slurm lab.
SLURM_INVENTORY = """\
cluster: hpc
defaults: {python: /opt/tf/bin/python3, workdir: ~/.dtf}
slurm:
  login: {host: login.example.org}
  nodes: 2
  ps: 1
  workers: 1
"""


def slurm_record(submitted: bool = True):
    """SLURM_INVENTORY's record: job 77 (dtf's own unless `submitted` is False) on n1 and n2."""
    from dtf.cluster.allocation import Allocation
    from dtf.cluster.inventory import loads
    from dtf.cluster.plan import make_plan
    from dtf.cluster.state import Record
    from dtf.providers.slurm import commands as slurm

    inv = loads(SLURM_INVENTORY, "inventory.yaml")
    assert inv.slurm is not None
    alloc = Allocation(job="77", submitted=submitted, login=inv.slurm.login, nodes=("n1", "n2"),
                       addresses=("10.0.0.1", "10.0.0.2"), request=slurm.request(inv))
    return Record(plan=make_plan(inv.with_nodes(alloc.nodes), allocation=alloc), inventory="/x/inventory.yaml",
                  created=1.0, chief_host="10.0.0.9")
