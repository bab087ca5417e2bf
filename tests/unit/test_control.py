"""The pure parts of dtf.hosts.control: ssh's failures as dtf's one-line reasons, where the sockets
live (one cluster's found by one prefix, jump hosts shared), and how long an unused master stays."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import Conversation
from dtf.hosts.control import cluster_prefix, hop_path, host_path, persist_for, reason
from dtf.hosts.masters import MasterFailed

SPEC = HostSpec(host="h7", line=3, connection="ssh", user="root", port=None, identity_file="~/.ssh/id_x",
                python="python3", workdir="~", address=None, ps_ports=(), worker_ports=())


def why(log: str, spec: HostSpec = SPEC, timed_out: bool = False) -> str:
    return reason(MasterFailed("failed", spec, log, timed_out), "root@h7", "~/.ssh/id_x", 3)


@pytest.mark.parametrize("log, expected", [
    ("root@10.0.0.7: Permission denied (publickey).",
     "authentication refused for root@h7 (tried ~/.ssh/id_x): root@10.0.0.7: Permission denied (publickey)."),
    ("Connection timed out during banner exchange\nConnection to UNKNOWN port 65535 timed out",
     "unreachable: no answer from root@h7 within 3s"),
    ("ssh: connect to host 10.0.0.7 port 22: Connection refused", "unreachable: root@h7: Connection refused"),
    ("ssh: connect to host 10.0.0.7 port 22: No route to host", "unreachable: root@h7: No route to host"),
    ("ssh: Could not resolve hostname h7: Name or service not known",
     "unreachable: cannot resolve h7: Name or service not known"),
    ("No ED25519 host key is known for 10.0.0.7 and you have requested strict checking.\n"
     "Host key verification failed.",
     "host key of root@h7 is unknown: add it to known_hosts (ssh once to h7) or set StrictHostKeyChecking accept-new"),
    ("@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\nHost key verification failed.",
     "host key of root@h7 does not match known_hosts: refusing to connect"),
    ("kex_exchange_identification: read: Connection reset by peer", "SSH to root@h7 failed: "
     "kex_exchange_identification: read: Connection reset by peer"),
])
def test_ssh_failures_read_as_dtfs_reasons(log: str, expected: str):
    assert why(log) == expected


def test_a_master_start_past_its_deadline_is_unreachable():
    assert why("", timed_out=True) == "unreachable: no answer from root@h7 within 3s"


def test_a_jump_host_failure_names_the_jump_host():
    bastion = replace(SPEC, host="bastion")
    assert why("root@bastion: Permission denied (publickey).", bastion).startswith(
        "authentication refused for jump host bastion of root@h7")


def test_one_clusters_sockets_share_a_prefix_and_its_jump_hosts_one_master():
    home = Path("/home/me/.dtf")
    prefix = cluster_prefix(home, "big")
    assert host_path(home, "big", "h1").startswith(prefix + "-")
    assert host_path(home, "big", "h1") != host_path(home, "big", "h2")
    assert not host_path(home, "other", "h1").startswith(prefix)
    bastion = replace(SPEC, host="bastion", port=None)
    assert hop_path(home, "big", bastion) == hop_path(home, "big", replace(bastion, line=9))
    assert hop_path(home, "big", bastion).startswith(prefix + "-j")
    assert len(host_path(home, "big", "a-very-long-host-name.example.org")) < 100  # a Unix socket path


def test_an_unused_master_stays_for_the_lease():
    assert persist_for(3600) == 3600
    assert persist_for(2) == 10  # never shorter than a command's own wait
    assert persist_for(0) == 3600  # a lease that never lapses: opened again when needed


def boot(tmp_path: Path, data: bytes, *args: str, size: int | None = None) -> Conversation:
    """put_and_converse's command on this machine: what the host's shell runs, ssh left out."""
    import sys

    from dtf.hosts.control import _BOOT
    from dtf.hosts.shell import render

    d = tmp_path / "root" / "below"  # (made by the boot itself)
    argv = [sys.executable, "-c", _BOOT, str(len(data) if size is None else size), f"{d}/app.pyz", f"{d}/.app.tmp", *args]
    return Conversation(["sh", "-c", render(argv)], data)


def test_the_upload_a_conversation_begins_with_is_read_to_its_last_byte_and_stdin_stays_the_commands(
        tmp_path: Path):
    """The host's python reads the upload itself, exactly its size (the rest of stdin is the
    command's: `up`'s "go"), writes it atomically, and runs it as `python FILE ARGS` would: the
    zip first on sys.path (its modules import; the current directory's do not shadow them), its
    __main__ as __main__, without runpy's and pkgutil's imports (a cost on every host)."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("inside.py", "WHERE = 'the zip'\n")
        zf.writestr("__main__.py", "import os, sys\nprint('argv', sys.argv[0] == os.path.abspath(sys.argv[0]), "
                                   "sys.argv[1:], flush=True)\n"
                                   "from inside import WHERE\n"
                                   "print('path', sys.path[0] == sys.argv[0], '' not in sys.path, WHERE, __name__, "
                                   "'runpy' in sys.modules or 'pkgutil' in sys.modules, flush=True)\n"
                                   "print('said', os.read(0, 64).decode().strip())\n")
    data = buffer.getvalue()
    conv = boot(tmp_path, data, "a", "b c")
    assert conv.readline(30) == "argv True ['a', 'b c']"
    assert conv.readline(30) == "path True True the zip __main__ False"
    conv.send("go")
    assert conv.readline(30) == "said go"
    r = conv.finish(30)
    assert (r.exit_code, r.stdout) == (0, "")
    assert (tmp_path / "root" / "below" / "app.pyz").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "root" / "below").iterdir()) == ["app.pyz"]

    short = boot(tmp_path, data[:100], size=len(data))  # the laptop went before it had sent it all
    r = short.finish(30)
    assert r.exit_code == 1 and "the upload ended early" in r.stderr


def test_a_conversation_that_says_nothing_in_time_is_none_and_finish_ends_it(tmp_path: Path):
    # exec: the command is one process, as ssh is (a sleep left behind by a killed sh would hold
    # stderr open, and finish would wait on its reader for seconds)
    conv = Conversation(["sh", "-c", "cat >/dev/null; exec sleep 60"], b"x")
    assert conv.readline(0.2) is None
    r = conv.finish(0.2)
    assert r.exit_code < 0 and conv.proc.poll() is not None


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_the_mux_switch_is_dtf_ssh_mux(monkeypatch: pytest.MonkeyPatch, value: str | None, enabled: bool):
    """DTF_SSH_MUX=0: a conversation goes through ssh's own mux client (the lab tests both ways)."""
    from dtf.hosts import mux

    if value is None:
        monkeypatch.delenv(mux.SWITCH, raising=False)
    else:
        monkeypatch.setenv(mux.SWITCH, value)
    assert mux.enabled() is enabled
