"""SlurmStepRunner.start_servers, the login host's side of a node's start on Slurm, on this machine:
the login host is a local shell, and `srun` a stand-in that runs the step's command here (its
options dropped), in the foreground as srun does. What is checked is the login host's script: it
returns once the step has said its lines, while the step goes on; a step that ends says its exit
status; stderr comes back; a silent step is given up at the deadline, with what it said."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import HostError, Result, ServerStart
from dtf.hosts.local import LocalRunner
from dtf.providers.slurm.steps import SlurmStepRunner, step_result
from helpers import within

SPEC = HostSpec(host="n1", line=1, connection="slurm", user=None, port=None, identity_file=None,
                python="python3", workdir="/tmp", address=None, ps_ports=(), worker_ports=())
SRUN = """#!/bin/sh
while [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""


class Login(LocalRunner):
    """The login host: a local shell (LocalRunner.run_with_input runs the command with its input)."""


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlurmStepRunner:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    allocation = Allocation(job="7", submitted=True, login=SPEC, nodes=("n1",), addresses=("127.0.0.1",))
    return SlurmStepRunner(SPEC, allocation, login=Login(SPEC))


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


def test_it_returns_with_the_lines_while_the_step_stays(node: SlurmStepRunner, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    script = f'echo $$ > {pid}; echo check; echo started; echo oops >&2; exec sleep 3600'
    # (waiting for the step's end, or for more lines until the deadline, would hang)
    r = within(60, lambda: node.start_servers(ServerStart(["sh", "-c", script], "dtf-c-ps:0", lines=2, timeout=3600)))
    try:
        assert (r.exit_code, r.stdout) == (0, "check\nstarted\n"), r
        assert "oops" in r.stderr
        assert alive(pid)  # the step goes on, detached from the command that started it
    finally:
        stop(pid)


def test_a_step_that_ends_says_its_exit_status(node: SlurmStepRunner) -> None:
    r = node.start_servers(ServerStart(["sh", "-c", "echo check; echo why >&2; exit 3"], "dtf-c-ps:0", lines=2, timeout=30))
    assert (r.exit_code, r.stdout) == (3, "check\n") and "why" in r.stderr, r
    r = node.start_servers(ServerStart(["/nonexistent/python3", "launcher"], "dtf-c-ps:0", lines=2, timeout=30))
    assert (r.exit_code, r.stdout) == (127, ""), r  # as over SSH: `python missing`


def test_the_upload_is_written_before_the_command_runs(node: SlurmStepRunner, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    target = tmp_path / "root"
    script = f'echo $$ > {pid}; cat {target}/launcher.pyz; echo; exec sleep 60'
    r = node.start_servers(ServerStart(["sh", "-c", script], "dtf-c-ps:0", lines=1, timeout=30,
                                  upload=(b"the launcher", str(target), "launcher.pyz")))
    try:
        assert (r.exit_code, r.stdout) == (0, "the launcher\n"), r
        assert [p.name for p in target.iterdir()] == ["launcher.pyz"]
    finally:
        stop(pid)


def test_a_silent_step_is_given_up_at_the_deadline(node: SlurmStepRunner, tmp_path: Path) -> None:
    pid = tmp_path / "pid"
    try:
        with pytest.raises(HostError, match=r"^job step dtf-c-ps:0 said 1 of its 2 line\(s\) within 1s$"):
            within(60, lambda: node.start_servers(ServerStart(["sh", "-c", f"echo $$ > {pid}; echo check; exec sleep 3600"],
                                                         "dtf-c-ps:0", lines=2, timeout=1)))
    finally:
        stop(pid)


def test_kept_result_reads_the_exit_line() -> None:
    assert step_result(Result(0, "a\nb\n", "")) == Result(0, "a\nb\n", "")
    assert step_result(Result(0, "a\ndtf-step-exit 2\n", "e")) == Result(2, "a\n", "e")
    assert step_result(Result(124, "", "")) == Result(124, "", "")
