"""The SSH twins against the SSH lab: OpenSSH over the host's master (dtf.hosts.control) and the
paramiko fallback (dtf.hosts.paramikossh) give a collective copy's follower, a fetch of its output
and a command fed its input alike, each over its one open connection (no SSH login of their own).
The mux switch (DTF_SSH_MUX=0) runs a conversation through ssh's own mux client, with the same
stdin, stdout, stderr and exit status as the master's protocol spoken here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import CommandRunner, Conversation, HostError
from dtf.hosts.control import OpenSSHRunner
from dtf.hosts.masters import Master
from dtf.hosts.openssh import ssh_binary
from dtf.hosts.paramikossh import ParamikoRunner
from helpers import master_path, ssh_processes
from lab import Lab
from sites import LabSite

pytestmark = pytest.mark.lab


@pytest.fixture
def site(netns_site: LabSite) -> LabSite:
    return netns_site  # every test here needs hosts of their own addresses


def logins(lab: Lab, host: str) -> int:
    """SSH logins the host's sshd accepted so far (its log, LogLevel VERBOSE)."""
    return (lab.root / host / "sshd.log").read_text(errors="replace").count("Accepted publickey")


def h0_spec(site: LabSite) -> HostSpec:
    return HostSpec(host="h0", line=1, connection="ssh", user=None, port=None, identity_file=str(site.lab.key),
                    python=sys.executable, workdir="~", address=None, ps_ports=(), worker_ports=())


@pytest.fixture
def h0(site: LabSite):
    ssh = ssh_binary()
    assert ssh is not None
    master = Master(ssh, h0_spec(site), str(site.lab.ssh_config), master_path(site.home, "twin", "h0"))
    master.start()
    try:
        yield OpenSSHRunner(master)
    finally:
        master.stop()


@pytest.fixture(params=["openssh", "paramiko"])
def twin(request: pytest.FixtureRequest, site: LabSite):
    if request.param == "openssh":
        yield request.getfixturevalue("h0")
        return
    t = ParamikoRunner(h0_spec(site), str(site.lab.ssh_config), 10)
    with t:
        yield t


def test_a_follower_a_fetch_and_a_fed_command_go_over_the_open_connection(site: LabSite, twin: CommandRunner,
                                                                          tmp_path: Path):
    h0 = twin
    h0.open()
    before = logins(site.lab, "h0")
    out = h0.output(["sh", "-c", "echo to-out; echo to-err >&2"])
    got: dict[str, bytes] = {"out": b"", "err": b""}
    try:
        while (chunks := out.read(30)) is not None:
            for kind, data in chunks:
                got[kind] += data
    finally:
        out.close()
    assert got == {"out": b"to-out\n", "err": b"to-err\n"}

    assert h0.run(["sh", "-c", "rm -rf ~/twin && mkdir -p ~/twin/d && printf x > ~/twin/a && printf y > ~/twin/d/b"]).ok
    assert h0.fetch_tree("~/twin", tmp_path / "back") == 2
    assert (tmp_path / "back" / "a").read_text() == "x" and (tmp_path / "back" / "d" / "b").read_text() == "y"
    assert h0.fetch_tree("~/no-such-dir", tmp_path / "none") == 0
    r = h0.run_with_input(["sh", "-c", "cat; echo; echo e >&2; exit 4"], b"fed")
    assert (r.exit_code, r.stdout, r.stderr) == (4, "fed\n", "e\n")
    assert logins(site.lab, "h0") == before  # every session was the open connection's


@pytest.mark.parametrize("mux", ["1", "0"])
def test_the_mux_switch(h0: OpenSSHRunner, monkeypatch: pytest.MonkeyPatch, mux: str):
    monkeypatch.setenv("DTF_SSH_MUX", mux)
    conv: Conversation = h0.converse(["sh", "-c", 'head -c 5; echo; read line; echo "got $line"; echo e >&2; exit 3'],
                                     b"hello")
    # The master alone where the protocol is spoken here; its ssh mux client beside it otherwise.
    assert len(ssh_processes()) == (1 if mux == "1" else 2)
    first = conv.readline(30)
    conv.send("go")
    second = conv.readline(30)
    r = conv.finish(30)
    assert (first, second, r.exit_code, r.stdout, r.stderr) == ("hello", "got go", 3, "", "e\n")


@pytest.mark.parametrize("mux", ["1", "0"])
def test_a_master_is_closed_both_ways(h0: OpenSSHRunner, monkeypatch: pytest.MonkeyPatch, mux: str):
    """`dtf down` closes a master over its control socket, or with `ssh -O exit` (DTF_SSH_MUX=0):
    either way it has exited, its socket removed, when stop returns."""
    monkeypatch.setenv("DTF_SSH_MUX", mux)
    h0.open()
    pid = h0.master.pid()
    assert pid is not None
    h0.master.stop()
    assert not Path(h0.master.path).exists()
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert ssh_processes() == []


@pytest.mark.parametrize("mux", ["1", "0"])
def test_a_command_runs_alike_both_ways(h0: OpenSSHRunner, monkeypatch: pytest.MonkeyPatch, mux: str):
    """`run` over the master's protocol and through ssh's mux client: the same bytes in and out,
    the same exit status, the same timeout."""
    monkeypatch.setenv("DTF_SSH_MUX", mux)
    r = h0.run_with_input(["sh", "-c", "cat; printf no-newline; printf e >&2; exit 5"], b"x\ny")
    assert (r.exit_code, r.stdout, r.stderr) == (5, "x\nyno-newline", "e")
    with pytest.raises(HostError, match="timed out after 1s"):
        h0.run(["sleep", "30"], timeout=1)
    assert h0.run(["true"]).ok
