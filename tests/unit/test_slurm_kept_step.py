"""SlurmStepTransport.start_kept, the login host's side of a node's start on Slurm, on this machine:
the login host is a local shell, and `srun` a stand-in that runs the step's command here (its
options dropped), in the foreground as srun does. What is checked is the login host's script: it
returns once the step has said its lines, while the step goes on; a step that ends says its exit
status; stderr comes back; a silent step is given up at the deadline, with what it said."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtf.cluster import slurm
from dtf.cluster.inventory import HostSpec
from dtf.cluster.slurm import Allocation
from dtf.hosts.slurmstep import EarlySteps, KeptStart, SlurmStepTransport, forget_begun, kept_result
from dtf.hosts.transport import HostError, LocalTransport, Result
from helpers import wait_until, within

SPEC = HostSpec(host="n1", line=1, connection="slurm", user=None, port=None, identity_file=None,
                python="python3", workdir="/tmp", address=None, ps_ports=(), worker_ports=())
SRUN = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


class Login(LocalTransport):
    """The login host: a local shell (LocalTransport.run_with_input runs the command with its input)."""


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmStepTransport:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    allocation = Allocation(job="7", submitted=True, login=SPEC, nodes=("n1",), addresses=("127.0.0.1",))
    return SlurmStepTransport(SPEC, allocation, login=Login(SPEC))


def alive(pid_file: Path) -> bool:
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def stop(pid_file: Path) -> None:
    subprocess.run(["pkill", "-F", str(pid_file)], check=False)


def test_it_returns_with_the_lines_while_the_step_stays(node: SlurmStepTransport, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    script = f'echo $$ > {pid}; echo check; echo started; echo oops >&2; exec sleep 3600'
    # (waiting for the step's end, or for more lines until the deadline, would hang)
    r = within(60, lambda: node.start_kept(KeptStart(["sh", "-c", script], "dtf-c-ps:0", lines=2, timeout=3600)))
    try:
        assert (r.exit_code, r.stdout) == (0, "check\nstarted\n"), r
        assert "oops" in r.stderr
        assert alive(pid)  # the step goes on, detached from the command that started it
    finally:
        stop(pid)


def test_a_step_that_ends_says_its_exit_status(node: SlurmStepTransport) -> None:
    r = node.start_kept(KeptStart(["sh", "-c", "echo check; echo why >&2; exit 3"], "dtf-c-ps:0", lines=2, timeout=30))
    assert (r.exit_code, r.stdout) == (3, "check\n") and "why" in r.stderr, r
    r = node.start_kept(KeptStart(["/nonexistent/python3", "launcher"], "dtf-c-ps:0", lines=2, timeout=30))
    assert (r.exit_code, r.stdout) == (127, ""), r  # as over SSH: `python missing`


def test_the_upload_is_written_before_the_command_runs(node: SlurmStepTransport, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    target = tmp_path / "root"
    script = f'echo $$ > {pid}; cat {target}/launcher.pyz; echo; exec sleep 60'
    r = node.start_kept(KeptStart(["sh", "-c", script], "dtf-c-ps:0", lines=1, timeout=30,
                                  upload=(b"the launcher", str(target), "launcher.pyz")))
    try:
        assert (r.exit_code, r.stdout) == (0, "the launcher\n"), r
        assert [p.name for p in target.iterdir()] == ["launcher.pyz"]
    finally:
        stop(pid)


def test_a_silent_step_is_given_up_at_the_deadline(node: SlurmStepTransport, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    try:
        with pytest.raises(HostError, match=r"^job step dtf-c-ps:0 said 1 of its 2 line\(s\) within 1s$"):
            within(60, lambda: node.start_kept(KeptStart(["sh", "-c", f"echo $$ > {pid}; echo check; exec sleep 3600"],
                                                         "dtf-c-ps:0", lines=2, timeout=1)))
    finally:
        stop(pid)


def test_kept_result_reads_the_exit_line() -> None:
    assert kept_result(Result(0, "a\nb\n", "")) == Result(0, "a\nb\n", "")
    assert kept_result(Result(0, "a\ndtf-step-exit 2\n", "e")) == Result(2, "a\n", "e")
    assert kept_result(Result(124, "", "")) == Result(124, "", "")


# -- the nodes' steps begun by the command that allocates them (EarlySteps) ---------------------
NODES = "NodeName=n2 Arch=x86_64 NodeAddr=10.0.0.2 State=ALLOCATED\nNodeName=n1 NodeAddr=10.0.0.1 State=ALLOCATED"
ALLOCATION = Allocation(job="7", submitted=True, login=SPEC, nodes=("n2", "n1"), addresses=("10.0.0.2", "10.0.0.1"))
OTHER = {"n2": "10.0.0.1", "n1": "10.0.0.2"}  # the other node's address


@pytest.fixture
def login_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The login host's Slurm commands, on this machine: salloc grants job 7 at once, squeue says it
    runs on n[1-2], scontrol names them in Slurm's order (n2 first), srun runs its command here.
    Yields the file the steps write their pids to: they are ended, and what was begun forgotten,
    after the test."""
    bin_dir = tmp_path / "bin"
    scripts = {
        "salloc": 'echo "salloc: Granted job allocation 7" >&2',
        "squeue": 'echo "RUNNING|None|n[1-2]|0:01|59:59"',
        "scontrol": f"cat <<'EOF'\n{NODES}\nEOF",
        "scancel": f'echo "$@" >> "{bin_dir}/scancel.args"',
        "srun": SRUN.removeprefix("#!/bin/sh\n"),
    }
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    pids = tmp_path / "pids"
    yield pids
    forget_begun()
    for pid in pids.read_text().split() if pids.exists() else []:
        subprocess.run(["kill", pid], check=False)


def start_of(tmp_path: Path, script: str, node: str, other: str, timeout: float = 30) -> KeptStart:
    """A node's start: `script` run by sh with $1 the node, $2 the other node's address and $3 the
    directory the upload is written to."""
    root = str(tmp_path / "root" / node)
    return KeptStart(["sh", "-c", script, "sh", node, other, root], f"dtf-c-{node}", 2, timeout,
                     upload=(b"the launcher", root, "launcher.pyz"))


def begin(tmp_path: Path, script: str, timeout: float = 30) -> tuple[EarlySteps, subprocess.Popen[bytes]]:
    """Both nodes' starts (start_of), of placeholder nodes as a plan of them has, begun by the
    command that allocates the job (running: its stdin written and closed)."""
    nodes, addresses = ("@dtf-node-0@", "@dtf-node-1@"), ("@dtf-address-0@", "@dtf-address-1@")
    steps = EarlySteps("@dtf-job@", nodes, addresses,
                       [start_of(tmp_path, script, node, addresses[1 - i], timeout) for i, node in enumerate(nodes)],
                       b"the launcher")
    proc = subprocess.Popen(slurm.wait_argv(submit=["salloc"], start=steps.script(), nodes=len(nodes)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(steps.upload)
    proc.stdin.close()
    proc.stdin = None  # (closed: communicate has nothing to send)
    return steps, proc


def answered(steps: EarlySteps, proc: subprocess.Popen[bytes]) -> int:
    """The command's answer read as `allocate` reads it: the nodes' answers taken (how many)."""
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    answer, begun, said = out.decode().partition(slurm.BEGUN_MARK)
    waited = slurm.parse_wait(answer)
    assert (waited.job, waited.nodes, waited.addresses) == ("7", ALLOCATION.nodes, dict(zip(ALLOCATION.nodes,
                                                                                          ALLOCATION.addresses)))
    return steps.take("7", waited.nodes, ALLOCATION.addresses, said) if begun else 0


class NoCommand(Login):
    def run_with_input(self, *args: object, **kwargs: object) -> Result:
        raise AssertionError("a start the allocation began runs no command of its own")


def node_of(name: str) -> SlurmStepTransport:
    spec = dataclasses.replace(SPEC, host=name)
    return SlurmStepTransport(spec, ALLOCATION, login=NoCommand(spec))


def test_the_command_that_allocates_the_nodes_begins_their_steps_and_each_node_takes_its_answer(
        login_host: Path, tmp_path: Path) -> None:
    """salloc, squeue and scontrol, then each node's step begun at once with the nodes' names and
    addresses as the login host learnt them (the upload on its stdin, written first): the answer
    holds the allocation and every step's lines. Each node's start_kept then takes its own answer
    without a command of its own; a start that is not the one begun is refused (a bug)."""
    # (stderr said before the lines the answer waits for: said after them, it may come after the answer)
    script = (f'echo $$ >> {login_host}; echo "said on stderr" >&2; echo "$1 reaches $2"; '
              'cat "$3/launcher.pyz"; echo; exec sleep 60')
    assert answered(*begin(tmp_path, script)) == 2
    assert len(login_host.read_text().split()) == 2 and all(alive_pid(p) for p in login_host.read_text().split())
    for node in ALLOCATION.nodes:
        got = node_of(node).start_kept(start_of(tmp_path, script, node, OTHER[node]))
        assert (got.exit_code, got.stdout) == (0, f"{node} reaches {OTHER[node]}\nthe launcher\n"), got
        assert "said on stderr" in got.stderr
    assert answered(*begin(tmp_path, script)) == 2
    with pytest.raises(HostError, match=r"^job step dtf-c-n1: the step the allocation began is not this "
                                        r"start's \(a bug in dtf\)"):
        node_of("n1").start_kept(KeptStart(["sh", "-c", "other"], "dtf-c-n1", 2, 30))


def test_a_step_begun_with_the_allocation_that_fails_or_stays_silent_is_said_as_any(
        login_host: Path, tmp_path: Path) -> None:
    """A begun step that ends says its exit status; one silent past its deadline is given up with
    what it said, as a step of its own command is (the node's start_kept says it)."""
    script = f'echo $$ >> {login_host}; echo check; [ "$1" = n1 ] && exit 3; exec sleep 60'
    assert answered(*begin(tmp_path, script, timeout=1)) == 2
    got = node_of("n1").start_kept(start_of(tmp_path, script, "n1", OTHER["n1"], timeout=1))
    assert (got.exit_code, got.stdout) == (3, "check\n"), got
    with pytest.raises(HostError, match=r"^job step dtf-c-n2 said 1 of its 2 line\(s\) within 1s$"):
        node_of("n2").start_kept(start_of(tmp_path, script, "n2", OTHER["n2"], timeout=1))


def test_a_laptop_gone_while_the_steps_start_cancels_the_job(login_host: Path, tmp_path: Path) -> None:
    """An `up` interrupted while the nodes' steps start (their servers slow to serve) has closed its
    session: the command's next heartbeat cannot be written, and it cancels the job (which ends
    the steps), without waiting for the steps."""
    # (steps that never say their second line, given an hour: waiting for them would hang)
    _, proc = begin(tmp_path, f'echo $$ >> {login_host}; echo check; exec sleep 3600', timeout=3600)
    assert proc.stdout is not None
    seen = b""
    while slurm.BEGUN_MARK.encode() not in seen:
        chunk = proc.stdout.read1(4096)
        assert chunk, seen
        seen += chunk
    proc.stdout.close()  # the laptop's end of the session: gone while the steps start
    cancelled = tmp_path / "bin" / "scancel.args"
    # at the next heartbeat, not at the steps' deadline (the fake scancel's line written whole: the
    # file exists as soon as the shell opened it)
    wait_until(lambda: cancelled.exists() and cancelled.read_text().endswith("\n"), timeout=60, every=0.02)
    assert cancelled.read_text() == "7\n"
    proc.kill()
    proc.wait()


def alive_pid(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError):
        return False


def test_render_with_makes_placeholders_the_remote_shells_variables() -> None:
    from dtf.hosts.shell import render_with

    variables = {"@n0@": "N0", "@a1@": "A1"}
    text = render_with(["srun", "--nodelist=@n0@", "@a1@:2222", "~/x y/@n0@", "it's", "~/"], variables)
    assert text == "srun --nodelist=\"${N0}\" \"${A1}\":2222 ~/'x y/'\"${N0}\" 'it'\"'\"'s' ~/"
    r = subprocess.run(["sh", "-c", f'N0=node1; A1=10.0.0.1; for a in {text}; do echo "[$a]"; done'],
                       capture_output=True, text=True, env={**os.environ, "HOME": "/home/u"})
    assert r.stdout.split("\n")[:6] == ["[srun]", "[--nodelist=node1]", "[10.0.0.1:2222]", "[/home/u/x y/node1]",
                                        "[it's]", "[/home/u/]"]


@pytest.mark.parametrize("slurm_keys, extra, begun", [
    ("", "", True),
    (", gpus_per_node: 2", "", True),
    (", python: managed", "", False),  # the environment is built between the check and the start
    ("", "firewall: members\n", True),  # the start closes the ports to non-members first
    ("", "sync: [{path: ., as: here}]\n", False),  # the mesh is checked after the packs
])
def test_the_steps_made_for_placeholder_nodes_are_the_starts_up_then_asks_of_the_real_ones(
        slurm_keys: str, extra: str, begun: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocation's command begins the nodes' starts before Slurm has named the nodes: made
    from a plan of placeholder nodes, they are, once the placeholders are the allocation's job,
    nodes and addresses, exactly the starts `up` asks of those nodes (else the node's start_kept
    refuses: a bug); none where `up` starts the nodes in several steps, or in turns."""
    from dtf.cluster.inventory import load
    from dtf.hostops import lifecycle
    from dtf.hostops.parallel import HostOps
    from dtf.hostops.start import Starter, local_tf_version

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "inv.yaml"
    path.write_text(f"cluster: c\nslurm: {{login: l, nodes: 2, ps: 1, workers: 2{slurm_keys}}}\n{extra}")
    inv = load(path)
    early = lifecycle.early_steps(inv, path, None, "fake", None)
    assert (early is not None) == begun
    if early is None:
        return
    nodes, addresses = ("n2", "n1"), ("10.0.0.2", "10.0.0.1")
    try:
        assert early.take("7", nodes, addresses, "".join(f"=== node {i} 0\no {i}\n" for i in range(2))) == 2
        allocation = Allocation(job="7", submitted=True, login=SPEC, nodes=nodes, addresses=addresses,
                                request=slurm.request(inv))
        plan = lifecycle.load_plan(path, None, "fake", None, slurm=allocation, inv=inv, config_checked=True)
        starter = Starter(HostOps(plan), mesh=True)
        starter._decide(plan.hosts)
        for hp in plan.hosts:
            start = starter._kept_check_start(hp, local_tf_version(), None)
            assert "@dtf-" not in " ".join(start.argv) and "10.0.0" in " ".join(start.argv)  # (the mesh's targets)
            t = SlurmStepTransport(hp.spec, allocation, login=NoCommand(hp.spec))
            assert t.start_kept(start).stdout == f"{nodes.index(hp.name)}\n"
    finally:
        forget_begun()
    monkeypatch.setenv("DTF_TURNS", "1")  # more nodes than `up` takes at once: in turns, none begun
    assert lifecycle.early_steps(inv, path, None, "fake", None) is None
