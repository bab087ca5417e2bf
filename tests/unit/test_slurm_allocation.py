"""dtf.providers.slurm.allocation against a scripted login host: what `up` submits, how it waits, and that
every way out of the wait (deadline, Ctrl-C, a job that fails) cancels what it submitted."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from dtf.cluster.inventory import loads
from dtf.errors import ExitCode, HostFailure
from dtf.hosts.base import COMMAND_TIMEOUT, CommandRunner, Result
from dtf.providers.slurm import allocation as slurm_ops

INV = "cluster: c\nslurm: {login: login1, nodes: 2, partition: p, workers: 1}\n"


class Answered:
    """A Conversation's stand-in: a Result's lines, one at a time, then its end."""

    def __init__(self, r: Result) -> None:
        self.r, self.lines = r, r.stdout.splitlines()

    def readline(self, timeout: float) -> str | None:
        return self.lines.pop(0) if self.lines else None

    def finish(self, timeout: float) -> Result:
        rest, self.lines = "".join(f"{line}\n" for line in self.lines), []
        return Result(self.r.exit_code, rest, self.r.stderr)

    def kill(self) -> None:
        pass


class Login(CommandRunner):
    """Answers Slurm commands from a script: squeue's answers in turn (the last one repeats)."""

    def __init__(self, squeue: list[str], on_squeue: Callable[[int], None] = lambda n: None) -> None:
        self.squeue, self.on_squeue = squeue, on_squeue
        self.ran: list[list[str]] = []
        self.cancelled = False
        self.polls = 0

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT, stdin: bytes | None = None,
            named: Sequence[str] | None = None) -> Result:
        argv = list(argv)
        if argv[:2] == ["sh", "-c"] and argv[2].startswith("scancel"):  # slurm.cancel_argv
            self.run(["scancel", argv[4]])
            while self.run(["squeue", f"--jobs={argv[4]}"]).stdout.strip():  # (never: cancelled)
                pass
            return Result(0, "", "")
        if argv[:2] == ["sh", "-c"] and "squeue" in argv[2]:  # slurm.wait_argv: one look (salloc first)
            return self.look(argv[4:], argv[2])
        self.ran.append(argv)
        if argv[0] == "salloc":
            return Result(0, "42\n", "")
        if argv[0] == "scancel":
            self.cancelled = True
            return Result(0, "", "")
        if argv[0] == "squeue":
            if self.cancelled:
                return Result(0, "", "")
            self.polls += 1
            self.on_squeue(self.polls)
            return Result(0, self.squeue[min(self.polls, len(self.squeue)) - 1], "")
        if argv[:2] == ["scontrol", "--oneliner"]:
            return Result(0, "NodeName=n1 Arch=x NodeAddr=10.0.0.1 x=y\nNodeName=n2 NodeAddr=10.0.0.2\n", "")
        return Result(127, "", f"{argv[0]}: not found")

    def converse(self, argv: Sequence[str], data: bytes) -> Answered:
        """The command that submits the job and begins its nodes' steps: answered as `run` answers
        it (this login host begins no step: its answer has no `=== dtf-start`)."""
        return Answered(self.run(argv))

    def look(self, args: list[str], script: str) -> Result:
        """What the wait script answers, from the commands it runs (the ones this fake answers);
        one squeue a look (its rounds on the login host are the script's, tested on its own). The
        step it starts once the job runs (`then`) is recorded as ["then", its sh]."""
        out = []
        if args[0] == "--submit":
            out.append("JOB " + self.run(args[4:]).stdout.strip())
            job = out[0][4:]
        else:
            job = args[0]
        state = self.run(["squeue", f"--jobs={job}"]).stdout
        out.append(state.strip())
        if state.startswith("RUNNING"):
            then = script.split("THEN=", 1)[1].split("\n", 1)[0]
            if then != "''":
                self.ran.append(["then", then])
            out += ["---", self.run(["scontrol", "--oneliner"]).stdout.strip()]
        return Result(0, "\n".join(out) + "\n", "")


@pytest.fixture
def login(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Login]:
    monkeypatch.setattr(slurm_ops, "POLL_MAX", 0.01)

    def make(squeue: list[str], **kw: Callable[[int], None]) -> Login:
        t = Login(squeue, **kw)
        monkeypatch.setattr(slurm_ops, "login_master", lambda *a, **kw: t)
        monkeypatch.setattr(slurm_ops, "close_masters", lambda cluster: None)
        return t

    return make


def test_submit_wait_and_learn_the_nodes(login: Callable[..., Login]) -> None:
    t = login(["PENDING|Resources|||1:00:00\n", "PENDING|Resources|||1:00:00\n", "RUNNING|None|n[1-2]|0:01|59:59\n"])
    said: list[str] = []
    alloc = slurm_ops.allocate(loads(INV), wait=30, say=said.append)
    assert (alloc.job, alloc.submitted, alloc.nodes, alloc.addresses) == ("42", True, ("n1", "n2"), ("10.0.0.1", "10.0.0.2"))
    assert t.ran[0][:3] == ["salloc", "--no-shell", "--job-name=dtf-c"] and "--partition=p" in t.ran[0]
    watch = [a for a in t.ran if a[0] == "then"]  # the lease watch, started by the look that saw it run
    assert len(watch) == 1 and "--job-name=dtf-c-lease" in watch[0][1]
    assert '--jobid="$job"' in watch[0][1] and '--nodelist="$first"' in watch[0][1]
    assert said[0] == "job 42 submitted: dtf-c, 2 node(s)"
    assert said[1].startswith("job 42: PENDING (Resources), waited 0s")
    assert said[-1].startswith("job 42 runs on n[1-2]")
    assert not t.cancelled


def test_the_deadline_cancels_and_waits_until_the_queue_forgets_it(login: Callable[..., Login]) -> None:
    t = login(["PENDING|ReqNodeNotAvail|||1:00:00\n"])
    said: list[str] = []
    with pytest.raises(HostFailure) as info:
        slurm_ops.allocate(loads(INV), wait=0.05, say=said.append)
    assert "job 42 still PENDING after 0.05s (ReqNodeNotAvail): cancelled" in "\n".join(info.value.lines())
    assert t.cancelled and ["scancel", "42"] in t.ran
    assert said[-1].startswith("job 42 cancelled; the queue no longer lists it")


def test_ctrl_c_while_pending_cancels(login: Callable[..., Login]) -> None:
    def interrupt(n: int) -> None:
        if n == 3:
            raise KeyboardInterrupt

    t = login(["PENDING|Priority|||1:00:00\n"], on_squeue=interrupt)
    with pytest.raises(KeyboardInterrupt):
        slurm_ops.allocate(loads(INV), wait=60, say=lambda line: None)
    assert t.cancelled


def test_a_job_that_fails_while_pending_is_one_line(login: Callable[..., Login]) -> None:
    login(["PENDING|Resources|||1:00:00\n", "FAILED|NonZeroExitCode|||0:00\n"])
    with pytest.raises(HostFailure) as info:
        slurm_ops.allocate(loads(INV), wait=60, say=lambda line: None)
    assert "job 42 is FAILED (NonZeroExitCode)" in "\n".join(info.value.lines())


def test_an_existing_job_is_never_submitted_nor_cancelled(login: Callable[..., Login]) -> None:
    t = login(["PENDING|Resources|||1:00:00\n"])
    inv = loads("cluster: c\nslurm: {login: login1, job: 7, workers: 1}\n")
    with pytest.raises(HostFailure):
        slurm_ops.allocate(inv, wait=0.05, say=lambda line: None)
    assert not [a for a in t.ran if a[0] in ("salloc", "scancel", "then") or a[:2] == ["sh", "-c"]]


def test_an_up_whose_ssh_config_is_wrong_opens_no_master(login: Callable[..., Login], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The inventory's ssh_config is checked before the login host is asked anything: its mistake
    at its line, and no master opened."""
    from typer.testing import CliRunner

    from dtf.cli import app

    if shutil.which("ssh") is None:
        pytest.skip("no ssh: ssh_config is read by paramiko alone")
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    asked: list[object] = []
    monkeypatch.setattr(slurm_ops, "login_master", lambda *a, **kw: asked.append(a))
    (tmp_path / "ssh_config").write_text("Host login1\n  NoSuchOption yes\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"ssh_config: {tmp_path / 'ssh_config'}\n" + INV)
    r = CliRunner().invoke(app, ["up", str(inv)])
    assert r.exit_code == int(ExitCode.INVENTORY), r.output
    assert "inv.yaml:1:1: ssh_config:" in r.output and "line 2: Bad configuration option" in r.output
    assert asked == []
