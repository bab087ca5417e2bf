"""The pure parts of ssh network mode (dtf.hosts.masters): jump hosts as ssh prints them (`ssh -G`)."""

from __future__ import annotations

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts.masters import parse_jump

SPEC = HostSpec(host="target", line=3, connection="ssh", user="alice", port=2200, identity_file="~/.ssh/id_x",
                python="python3", workdir="~", address=None, ps_ports=(), worker_ports=())


@pytest.mark.parametrize("text, user, host, port", [
    ("bastion", None, "bastion", None),
    ("bob@bastion:2222", "bob", "bastion", 2222),
    ("ssh://bob@bastion:2222", "bob", "bastion", 2222),
    ("[10.0.0.5]:22", None, "10.0.0.5", 22),  # ssh -G brackets numeric addresses
    ("[10.0.0.5]", None, "10.0.0.5", None),
    ("carol@[fe80::1]:2022", "carol", "fe80::1", 2022),
    (" jump ", None, "jump", None),
])
def test_a_jump_hop_is_a_spec_of_its_own(text: str, user: str | None, host: str, port: int | None) -> None:
    hop = parse_jump(text, SPEC)
    assert (hop.user, hop.host, hop.port) == (user, host, port)
    assert hop.identity_file is None  # the inventory's key is the target's, not the jump host's
