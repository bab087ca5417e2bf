"""The TF ports' firewall rules as text (dtf_server.firewall): what a host's start loads, and how a
later start reads the tags back. The rules themselves are set and removed on the SSH lab
(tests/fake/test_firewall.py)."""

from __future__ import annotations

import os

from dtf_server import firewall


def test_the_table_replaces_its_namesake_in_one_transaction_and_carries_its_tag():
    script = firewall.nft_script("dtf_0123456789", [2222, 2223], ["10.0.0.1"], ["fd00::1"], "dtf uid=0 root=/r")
    assert script.splitlines() == [
        "table inet dtf_0123456789 {}",  # (made if missing: the delete that follows never fails)
        "delete table inet dtf_0123456789",
        "table inet dtf_0123456789 {",
        "  chain input {",
        "    type filter hook input priority filter - 1; policy accept;",
        '    iif "lo" tcp dport { 2222, 2223 } accept',
        "    ip saddr { 10.0.0.1 } tcp dport { 2222, 2223 } accept",
        "    ip6 saddr { fd00::1 } tcp dport { 2222, 2223 } accept",
        '    tcp dport { 2222, 2223 } reject with tcp reset comment "dtf uid=0 root=/r"',
        "  }",
        "}"]


def test_iptables_chain_jumps_fifteen_ports_at_a_time_and_tags_its_reject_rule():
    cmds = firewall.iptables_commands("iptables", "dtf_0123456789", list(range(3000, 3016)), ["10.0.0.1"], "dtf uid=0 root=/r")
    assert cmds[:4] == [
        ["iptables", "-N", "DTF-0123456789"],
        ["iptables", "-A", "DTF-0123456789", "-i", "lo", "-j", "ACCEPT"],
        ["iptables", "-A", "DTF-0123456789", "-s", "10.0.0.1", "-j", "ACCEPT"],
        ["iptables", "-A", "DTF-0123456789", "-p", "tcp", "-m", "comment", "--comment", "dtf uid=0 root=/r",
         "-j", "REJECT", "--reject-with", "tcp-reset"]]
    assert [c[8] for c in cmds[4:]] == [",".join(map(str, range(3000, 3015))), "3015"]


def test_a_tag_names_the_user_and_the_cluster_directory_and_reads_back(tmp_path):
    root = tmp_path / "a dir" / "c"
    tag = firewall.tag(str(root))
    assert tag == f"dtf uid={os.geteuid()} root={str(root).replace(' ', '%20')}"
    listed = ("table inet other {\n\tchain input {\n\t\tcomment \"dtf uid=0 root=/not/ours\"\n\t}\n}\n"
              "table inet dtf_00aa11bb22 {\n\tchain input {\n"
              f"\t\ttcp dport {{ 2222 }} reject with tcp reset comment \"{tag}\"\n\t}}\n}}\n")
    assert firewall.nft_tags(listed) == {"dtf_00aa11bb22": (os.geteuid(), str(root))}
    rules = ("-P INPUT ACCEPT\n-N DTF-00AA11BB22\n-A INPUT -p tcp -m multiport --dports 2222 -j DTF-00AA11BB22\n"
             f"-A DTF-00AA11BB22 -p tcp -m comment --comment \"{tag}\" -j REJECT --reject-with tcp-reset\n")
    assert firewall.iptables_tags(rules) == {"dtf_00aa11bb22": (os.geteuid(), str(root))}


def test_a_directory_too_long_for_a_comment_is_left_out_of_the_tag():
    tag = firewall.tag("/" + "d" * 200)
    assert tag == f"dtf uid={os.geteuid()} root=-" and len(tag) <= firewall.TAG_MAX
    assert firewall.nft_tags(f'table inet dtf_00aa11bb22 {{\n comment "{tag}"\n}}\n') == {
        "dtf_00aa11bb22": (os.geteuid(), "")}  # never swept by another start: only by its own cluster
