"""The pure parts of dtf.hosts.control: ssh's failures as dtf's one-line reasons, where the sockets
live (one cluster's found by one prefix, jump hosts shared), and how long an unused master stays."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts.control import cluster_prefix, hop_path, host_path, persist_for, reason
from dtf.hosts.tunnel import MasterFailed

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
