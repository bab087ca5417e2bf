"""The OpenSSH twin (dtf.hosts.control) against the SSH lab: a collective copy's follower and a
fetch of its output go over the host's master alone (no SSH login of their own, no paramiko), and
the mux switch (DTF_SSH_MUX=0) runs a conversation through ssh's own mux client, with the same
stdin, stdout, stderr and exit status as the master's protocol spoken here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import Conversation
from dtf.hosts.control import ControlTransport
from dtf.hosts.masters import Master, control_path, ssh_binary
from helpers import ssh_processes
from lab import Lab
from sites import LabSite

pytestmark = pytest.mark.lab


@pytest.fixture
def site(tmp_path: Path, lab: Lab):
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    the_site = LabSite(tmp_path, lab)
    try:
        yield the_site
    finally:
        the_site.cleanup()


def logins(lab: Lab, host: str) -> int:
    """SSH logins the host's sshd accepted so far (its log, LogLevel VERBOSE)."""
    return (lab.root / host / "sshd.log").read_text(errors="replace").count("Accepted publickey")


@pytest.fixture
def h0(site: LabSite):
    ssh = ssh_binary()
    assert ssh is not None
    spec = HostSpec(host="h0", line=1, connection="ssh", user=None, port=None, identity_file=str(site.lab.key),
                    python=sys.executable, workdir="~", address=None, ps_ports=(), worker_ports=())
    master = Master(ssh, spec, str(site.lab.ssh_config), control_path(site.home, "twin", "h0"))
    master.start()
    try:
        yield ControlTransport(master)
    finally:
        master.stop()


def test_a_follower_and_a_fetch_go_over_the_master_alone(site: LabSite, h0: ControlTransport, tmp_path: Path):
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
    assert logins(site.lab, "h0") == before  # every session was the master's


@pytest.mark.parametrize("mux", ["1", "0"])
def test_the_mux_switch(h0: ControlTransport, monkeypatch: pytest.MonkeyPatch, mux: str):
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
