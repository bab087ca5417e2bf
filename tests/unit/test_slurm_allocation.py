"""dtf.hostops.slurm against a scripted login host: what `up` submits, how it waits, and that
every way out of the wait (deadline, Ctrl-C, a job that fails) cancels what it submitted."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtf.cluster.inventory import loads
from dtf.errors import ExitCode, HostFailure
from dtf.hostops import slurm as slurm_ops
from dtf.hosts import spawn
from dtf.hosts.control import ControlTransport
from dtf.hosts.transport import COMMAND_TIMEOUT, HostError, Result, Transport

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


class Login(Transport):
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
            then = script.split("THEN=", 1)[1].split("; START=", 1)[0]
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


class ControlLogin(Login, ControlTransport):
    """The scripted login host, as the master transport `login_master` gives where there is an
    ssh: opened (the handshake) once, slowly, in the head start's thread."""

    def __init__(self, squeue: list[str], fail: str | None = None) -> None:
        Login.__init__(self, squeue)
        self.master = SimpleNamespace(path="/nonexistent/dtf-ctl-test", argv=None)  # type: ignore[assignment]
        self.fail, self.opened_in = fail, []

    def open(self) -> None:
        if self.opened_in:  # the master runs: a use of it (ControlTransport.open)
            return
        time.sleep(0.05)
        if self.fail:
            raise HostError(self.fail)
        self.opened_in.append(threading.current_thread().name)


@pytest.fixture
def head_login(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[ControlLogin, list[str]]]:
    """A ControlLogin as the login host's master, and the clusters whose masters were closed."""
    monkeypatch.setattr(slurm_ops, "POLL_MAX", 0.01)

    def make(squeue: list[str], fail: str | None = None,
             running: bool = False) -> tuple[ControlLogin, list[str]]:
        t = ControlLogin(squeue, fail)
        closed: list[str] = []
        made: list[ControlLogin] = []

        def login_master(*a: object, **kw: object) -> ControlLogin:
            made.append(t)
            assert len(made) == 1, "the login host's master is asked for once"
            return t

        monkeypatch.setattr(slurm_ops, "login_master", login_master)
        monkeypatch.setattr(slurm_ops, "close_masters", closed.append)
        monkeypatch.setattr(spawn, "listening", lambda path: running)
        return t, closed

    return make


def test_the_head_start_opens_the_login_master_in_its_thread_and_up_goes_on_over_it(
        head_login: Callable[..., tuple[ControlLogin, list[str]]]) -> None:
    t, closed = head_login(["RUNNING|None|n[1-2]|0:01|59:59\n"])
    inv = loads(INV)
    head = slurm_ops.HeadStart(inv)
    alloc = slurm_ops.allocate(inv, wait=30, say=lambda line: None, head=head)
    assert alloc.nodes == ("n1", "n2") and t.ran[0][0] == "salloc"
    assert t.opened_in == ["dtf-login-master"] and closed == []


def test_a_head_start_that_failed_fails_the_allocation_at_the_login_host_without_a_second_try(
        head_login: Callable[..., tuple[ControlLogin, list[str]]]) -> None:
    t, closed = head_login(["RUNNING|None|n[1-2]|0:01|59:59\n"], fail="authentication refused for root@login1")
    inv = loads(INV)
    with pytest.raises(HostFailure) as info:
        slurm_ops.allocate(inv, wait=30, say=lambda line: None, head=slurm_ops.HeadStart(inv))
    assert info.value.lines()[-1].endswith("login1: authentication refused for root@login1")
    assert t.ran == [] and closed == ["c"]


@pytest.mark.parametrize("running", [False, True])
def test_an_abandoned_head_start_closes_the_master_it_opened_and_only_that(
        head_login: Callable[..., tuple[ControlLogin, list[str]]], running: bool) -> None:
    """An `up` that ends before its allocation (a mistake found meanwhile, Ctrl-C) leaves no master
    behind; a master that ran already is a running cluster's, and stays."""
    t, closed = head_login([], running=running)
    slurm_ops.HeadStart(loads(INV)).abandon()
    assert t.opened_in == ["dtf-login-master"]
    assert closed == ([] if running else ["c"])


def test_an_up_whose_ssh_config_is_wrong_leaves_no_master_of_its_head_start(
        head_login: Callable[..., tuple[ControlLogin, list[str]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from dtf.cli import app

    if shutil.which("ssh") is None:
        pytest.skip("no ssh: ssh_config is read by paramiko alone")
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    t, closed = head_login([])
    (tmp_path / "ssh_config").write_text("Host login1\n  NoSuchOption yes\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"ssh_config: {tmp_path / 'ssh_config'}\n" + INV)
    r = CliRunner().invoke(app, ["up", str(inv)])
    assert r.exit_code == int(ExitCode.INVENTORY), r.output
    assert "inv.yaml:1:1: ssh_config:" in r.output and "line 2: Bad configuration option" in r.output
    assert closed == ["c"] and t.ran == []


@pytest.mark.parametrize("argv, expected", [
    (["up", "inv.yaml"], ("inv.yaml", None, None)),
    (["up", "--ttl", "2h", "inv.yaml", "--connect-timeout=4"], ("inv.yaml", 4.0, 7200.0)),
    (["up", "inv.yaml", "--network", "ssh", "--slurm-wait=30"], ("inv.yaml", None, None)),
    (["up", "inv.yaml", "--ttl", "never"], ("inv.yaml", None, 0.0)),
    (["up"], None),
    (["up", "inv.yaml", "--dry-run"], None),
    (["up", "inv.yaml", "--replace"], None),
    (["up", "--help"], None),
    (["up", "a.yaml", "b.yaml"], None),
    (["up", "inv.yaml", "--ttl"], None),
    (["up", "inv.yaml", "--ttl", "soon"], None),
    (["up", "inv.yaml", "-x"], None),
    (["status"], None),
    (["--version", "up", "inv.yaml"], None),
])
def test_only_a_plain_up_begins_before_the_cli(argv: list[str], expected: object) -> None:
    from dtf.entry import up_arguments

    assert up_arguments(argv) == expected


def run_entry(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    from dtf import entry

    monkeypatch.setattr("sys.argv", ["dtf", *argv])
    with pytest.raises(SystemExit) as info:
        entry.main()
    return int(info.value.code or 0)


def test_dtf_up_takes_over_the_master_begun_before_the_cli(
        head_login: Callable[..., tuple[ControlLogin, list[str]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`dtf up` of a Slurm inventory: the login host's master is begun by dtf.entry, before the CLI
    loads, and the `up` goes on over it (login_master is asked once: head_login); the allocation
    that fails then closes it, as one begun by `up` itself."""
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    t, closed = head_login(["FAILED|NonZeroExitCode|||0:00\n"])
    inv = tmp_path / "inv.yaml"
    inv.write_text(INV)
    assert run_entry(["up", str(inv), "--connect-timeout", "7"], monkeypatch) == int(ExitCode.HOSTS)
    assert "job 42 is FAILED (NonZeroExitCode)" in capsys.readouterr().err
    assert t.opened_in == ["dtf-login-master"] and t.ran[0][0] == "salloc"
    assert closed == ["c"]


def test_a_master_begun_before_the_cli_for_an_up_that_never_takes_it_is_closed(
        head_login: Callable[..., tuple[ControlLogin, list[str]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    t, closed = head_login([])
    inv = tmp_path / "inv.yaml"
    inv.write_text(INV)
    assert run_entry(["up", str(inv), "--network", "carrier-pigeon"], monkeypatch) == int(ExitCode.USAGE)
    assert "--network: expected one of" in capsys.readouterr().err
    assert t.opened_in == ["dtf-login-master"] and t.ran == [] and closed == ["c"]


def test_a_ctrl_c_while_the_entry_begins_its_work_comes_once_that_is_done(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Not inside an import (a KeyboardInterrupt there can leave an import lock held by the main
    thread, which the head start's thread then waits for forever): begin_early's work ends, then
    the interrupt is raised; the command says so and exits 130; SIGINT's handler is Python's again."""
    import os
    import signal

    from dtf import entry

    done = []

    def work(path: str, timeout: float | None, ttl: float | None) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs between these: it only records)
        done.append(path)

    monkeypatch.setattr(entry, "_begin_early", work)
    # SIGINT's handler as in a `dtf` process (a pytest-xdist worker has its own)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_entry(["up", "inv.yaml"], monkeypatch) == 130
        assert done == ["inv.yaml"] and capsys.readouterr().err == "dtf: error: interrupted\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # where whoever started dtf ignores SIGINT, it stays ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        entry.begin_early(["up", "inv.yaml"])
        assert done == ["inv.yaml", "inv.yaml"] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
