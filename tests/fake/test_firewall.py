"""Who may connect to the TF ports under each `firewall:` setting, on the SSH lab with fake servers
(a TF port is a port: no TensorFlow needed). The cluster runs on h0 and h1; h2 is a machine of
the same network that is no member; the laptop is this machine. `firewall: members` and its
iptables variant: tests/fake/test_network.py. The hosts' users: root (the lab's login), a user
with passwordless sudo for the rule tools and one whose sudo asks for a password (the lab's
SUDO_USER and PASSWORD_SUDO_USER), and a user without root or sudo (unprivileged_python).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dtf_server.firewall import iptables_tags, nft_tags, rules_name
from helpers import assert_one_line_error, fake_server, status_json, wait_until
from lab import FIREWALL_TOOLS, PASSWORD_SUDO_USER, SUDO_USER
from sites import CLUSTER, LabSite, LocalSite

pytestmark = pytest.mark.lab

# Why a user without root may set no rule: whether the host has sudo or not.
NO_PRIVILEGE = (r"needs root or passwordless sudo(, and sudo is not installed| for \S+/nft \(sudo -n asks for "
                r"a password\))")


@pytest.fixture
def site(netns_site: LabSite) -> LabSite:
    return netns_site  # every test here needs hosts of their own addresses


def dtf_tables(site: LabSite, *hosts: str) -> dict[str, list[str]]:
    """dtf's nftables tables on each lab host."""
    return {h: [t for t in site.lab.tables(h) if t.startswith("inet dtf_")] for h in hosts}


def no_rules(site: LabSite) -> bool:
    return dtf_tables(site, "h0", "h1", "h2") == {"h0": [], "h1": [], "h2": []}


def laptop_tables() -> list[str]:
    """This machine's nftables tables (other tests' local clusters may have theirs)."""
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=10, check=True)
    return [line.removeprefix("table ").strip() for line in r.stdout.splitlines() if line.strip()]


def with_python(inv: Path, host: int, python: str) -> None:
    """The inventory's host number `host` runs this python."""
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"][host]["python"] = python
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))


def unprivileged_python(tmp_path: Path) -> str:
    """A python that runs as an ordinary user would, without root and without sudo: in a user
    namespace of its own, as uid 1000 (its files are root's on disk; it may set no firewall rule:
    the host's network belongs to the machine's first user namespace; sudo, where installed,
    cannot raise it to root)."""
    wrapper = tmp_path / "python-user"
    wrapper.write_text("#!/bin/sh\n"
                       "[ \"$(id -u)\" = 0 ] && exec unshare --user --map-user=1000 --map-group=1000 "
                       f"{sys.executable} \"$@\"\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_by_default_only_the_cluster_and_the_laptop_reach_the_tf_ports_until_down(site: LabSite):
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert status_json(site.home)["network"] == "direct"  # auto: the laptop is let in, and reaches them
    assert "the TF ports accept connections from this machine; closed to non-members (firewall: auto)" in r.stdout
    assert "warning" not in r.stderr
    for name, host in (("a", "h0"), ("b", "h1")):
        address = lab.host(host).address
        for port in site.ports_of(name):
            assert lab.connects(None, address, port)  # the laptop
            assert lab.connects("h1" if host == "h0" else "h0", address, port)  # the other member
            assert lab.connects(host, "127.0.0.1", port)  # loopback
            assert not lab.connects("h2", address, port)  # no member
    assert all(len(tables) == 1 for tables in dtf_tables(site, "h0", "h1").values())
    assert site.dtf("down").returncode == 0
    assert no_rules(site)


def test_in_ssh_mode_the_laptop_is_no_member(site: LabSite):
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    inv.write_text(inv.read_text() + "network: ssh\n")
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert ("the TF ports are closed to this machine: dtf reaches them through SSH; closed to non-members "
            "(firewall: auto)") in r.stdout
    a = lab.host("h0").address
    for port in site.ports_of("a"):
        assert not lab.connects(None, a, port)
        assert not lab.connects("h2", a, port)
        assert lab.connects("h1", a, port)
    assert site.dtf("status").returncode == 0  # (through SSH)
    assert site.dtf("down").returncode == 0
    assert no_rules(site)


def test_off_opens_the_ports_and_says_so(site: LabSite):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    inv.write_text(inv.read_text() + "firewall: off\n")
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("anyone who reaches them can run code on the hosts (firewall: off)") == 1
    assert site.lab.connects("h2", site.lab.host("h0").address, site.ports_of("a")[0])
    assert no_rules(site)
    assert site.dtf("down").returncode == 0


def test_a_host_that_cannot_set_rules_is_named_in_one_warning_and_still_works(site: LabSite, tmp_path: Path):
    """firewall: auto on a host whose user has neither root nor sudo: `up` goes on, and says in
    one line which hosts stay open and how to close them. firewall: members refuses that host."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    with_python(inv, 0, unprivileged_python(tmp_path))
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and re.fullmatch(
        rf"dtf: warning: firewall: auto could not close the TF ports on h0 \(h0: {NO_PRIVILEGE}\): anyone who "
        r"reaches them can run code there; root or passwordless sudo for nft or iptables closes them, firewall: "
        r"members refuses such hosts", warnings[0]), warnings
    assert "closed to non-members (firewall: auto) except on h0" in r.stdout
    assert lab.connects("h2", lab.host("h0").address, site.ports_of("a")[0])  # open, as said
    assert not lab.connects("h2", lab.host("h1").address, site.ports_of("b")[0])  # h1 could close its own
    assert site.dtf("status").returncode == 0
    assert site.dtf("down").returncode == 0
    assert no_rules(site) and site.files() == [] and site.processes() == []

    inv.write_text(inv.read_text() + "firewall: members\n")
    r = site.dtf("up", str(inv))
    error = assert_one_line_error(r, 4)
    assert re.search(rf"^  h0: firewall: members is not possible there: {NO_PRIVILEGE}$", error, re.M), error
    assert no_rules(site) and site.files() == [] and site.processes() == []


def test_nothing_is_left_after_a_failed_up(site: LabSite):
    """A server that crashes on h1 fails the `up`: the rules it set on both hosts go with the rollback."""
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    site.crash("b", "worker-1")
    r = site.dtf("up", str(inv))
    assert_one_line_error(r, 4, "h1: server crashed: worker:1")
    assert no_rules(site)
    assert site.processes() == []


def test_a_repair_sets_the_rules_again_in_place_of_the_old(site: LabSite):
    """Supervisors killed on h0, then `up` again (a repair: only h0's tasks restart): h0's rules are
    replaced, not doubled, and still close every port of the host (the repair's start names them all)."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    before = dtf_tables(site, "h0")["h0"]
    for pid, _ in lab.processes("h0"):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: lab.processes("h0") == [], timeout=30)
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert "restarted" in r.stdout
    assert dtf_tables(site, "h0")["h0"] == before
    for port in site.ports_of("a"):
        assert lab.connects("h1", lab.host("h0").address, port)
        assert not lab.connects("h2", lab.host("h0").address, port)
    assert site.dtf("down").returncode == 0
    assert no_rules(site)


def rule_sets(site: LabSite, host: str, tool: str) -> list[str]:
    """dtf's rule sets on a lab host: nftables tables, or iptables chains."""
    if tool == "nft":
        return dtf_tables(site, host)[host]
    listed = site.lab.run(host, ["iptables", "-S"], timeout=10).stdout.split("\n")
    return [line.split()[1] for line in listed if line.startswith("-N DTF-")]


def tools_python(tmp_path: Path, tools: str) -> str:
    """A python whose launcher tries only these firewall tools."""
    wrapper = tmp_path / f"python-{tools}"
    wrapper.write_text(f"#!/bin/sh\nDTF_FIREWALL_TOOLS={tools} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize("tool", ["nft", "iptables"])
def test_rules_of_killed_supervisors_go_with_the_hosts_next_up(site: LabSite, tmp_path: Path, tool: str):
    """Supervisors killed with SIGKILL remove nothing. Once their cluster's lease has lapsed, the
    next start on that host (here another cluster's) finds their rules by their tag and removes them."""
    lab = site.lab
    python = tools_python(tmp_path, tool)
    inv = site.inventory({"a": {"ps": 1, "workers": 1}}, python=python)
    assert site.dtf("up", str(inv), "--ttl", "3").returncode == 0
    stale = rule_sets(site, "h0", tool)
    assert len(stale) == 1
    for pid, _ in site.processes():
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: site.processes() == [], timeout=30)
    lease = json.loads((site.workdir("a") / CLUSTER / "lease.json").read_text())
    wait_until(lambda: time.time() > lease["renewed"] + lease["ttl"], timeout=30)
    assert rule_sets(site, "h0", tool) == stale  # nobody removed them

    other = lab.inventory(tmp_path / "other.yaml", [{"host": "h0", "workers": lab.ports(1)}], cluster="fk2",
                          python=python)
    r = site.dtf("up", str(other))
    assert r.returncode == 0, r.stderr
    now = rule_sets(site, "h0", tool)
    assert len(now) == 1 and now != stale  # fk2's own, and fk's are gone
    assert site.dtf("down", "--cluster", "fk2").returncode == 0
    assert site.dtf("down", "--cluster", CLUSTER).returncode == 0
    assert rule_sets(site, "h0", tool) == [] and site.files() == []


def test_the_laptops_own_servers_are_closed_to_other_machines(tmp_path: Path, netns_site: LabSite):
    """`connection: local` (the quick start): TensorFlow listens on every interface, so where
    this machine lets dtf (root here) the ports accept loopback only; a lab host, another machine
    on this machine's network, is refused. Nothing is left on this machine after `down`."""
    lab = netns_site.lab
    (tmp_path / "local").mkdir()
    local = LocalSite(tmp_path / "local")
    try:
        inv = local.inventory({"a": {"ps": 1, "workers": 1}})
        r = local.dtf("up", str(inv))
        assert r.returncode == 0, r.stderr
        ours = rules_name(str(local.workdir("a") / CLUSTER))
        assert f"inet {ours}" in laptop_tables()
        assert "TF ports on this machine: closed to other machines (firewall: auto)" in r.stdout
        laptop = f"{lab.subnet}.1"  # this machine, on the lab's network
        for port in local.ports_of("a"):
            assert lab.connects(None, "127.0.0.1", port)
            assert not lab.connects("h2", laptop, port)
        assert local.dtf("down").returncode == 0
        assert f"inet {ours}" not in laptop_tables()
    finally:
        local.cleanup()


def as_user(site: LabSite, inv: Path, hosts: dict[int, str], tools: str = "") -> None:
    """The inventory's host number i logs in as hosts[i] (a lab user, in its home there), with
    a python launcher that tries only these firewall `tools` (where given)."""
    doc = yaml.safe_load(inv.read_text())
    for i, user in hosts.items():
        entry = doc["hosts"][i]
        entry.update(site.lab.as_user(entry["host"], user))
        if tools:  # (written on the host: the laptop's files below the lab's root are root's only)
            python = f"{site.lab.home(entry['host'], user)}/python-{tools}"
            script = f"#!/bin/sh\nDTF_FIREWALL_TOOLS={tools} exec {entry['python']} \"$@\"\n"
            r = site.lab.run(entry["host"], ["sh", "-c", f'printf %s "$0" > {python} && chmod 0755 {python}', script])
            assert r.returncode == 0, r.stderr
            entry["python"] = python
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))


def every_rule_set(site: LabSite, host: str) -> list[str]:
    """dtf's rule sets on a lab host, whatever the tool: nftables tables (`inet dtf_...`), iptables
    and ip6tables chains (`iptables DTF-...`, `ip6tables DTF-...`)."""
    chains = [f"{tool} {line.split()[1]}" for tool in FIREWALL_TOOLS[1:]
              for line in site.lab.run(host, [tool, "-S"], timeout=10).stdout.splitlines() if line.startswith("-N DTF-")]
    return dtf_tables(site, host)[host] + chains


def rule_owners(site: LabSite, host: str, tool: str) -> list[int]:
    """The uids in the tags of dtf's rule sets on a lab host (the users that set them)."""
    if tool == "nft":
        tags = nft_tags(site.lab.run(host, ["nft", "list", "ruleset"], timeout=10).stdout)
    else:
        tags = iptables_tags(site.lab.run(host, ["iptables", "-S"], timeout=10).stdout)
    return [uid for uid, _ in tags.values()]


def left_by_user(site: LabSite, user: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The cluster's files and the processes left in that user's workdirs on h0 and h1."""
    files, procs = [], []
    for host in ("h0", "h1"):
        workdir = site.lab.as_user(host, user)["workdir"]
        found = site.lab.run(host, ["find", f"{workdir}/{CLUSTER}"], timeout=10)
        files += found.stdout.split()
        procs += site.lab.processes(workdir)
    return files, procs


@pytest.mark.parametrize("tool", ["nft", "iptables"])
def test_a_host_whose_user_has_passwordless_sudo_is_closed_by_default_and_under_members(site: LabSite, tool: str):
    """Both hosts' users are no root but may run the rule tools with sudo and no password: `up`
    sets the rules through sudo (tagged with that user), as it does for root; `down` removes them;
    `firewall: members` starts there."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    as_user(site, inv, {0: SUDO_USER, 1: SUDO_USER}, tools=tool)
    for setting, said, network in (
            ("auto", "the TF ports accept connections from this machine; closed to non-members (firewall: auto)",
             "direct"),
            ("members", "closed to non-members (firewall: members)", "ssh")):  # (the laptop is no member)
        if setting == "members":
            inv.write_text(inv.read_text() + "firewall: members\n")
        r = site.dtf("up", str(inv))
        assert r.returncode == 0, r.stderr
        assert said in r.stdout, r.stdout
        assert "warning" not in r.stderr, r.stderr
        assert status_json(site.home)["network"] == network
        for host in ("h0", "h1"):
            servers = [pid for pid, cmd in lab.processes(lab.as_user(host, SUDO_USER)["workdir"])
                       if fake_server(pid, cmd)]
            assert servers and {Path(f"/proc/{pid}").stat().st_uid for pid in servers} == {lab.uids[SUDO_USER]}
            assert rule_owners(site, host, tool) == [lab.uids[SUDO_USER]]  # set by that user, through sudo
            sets = every_rule_set(site, host)  # one table, or one chain per IP version
            assert [t.split()[0] for t in sets] == (["inet"] if tool == "nft" else ["iptables", "ip6tables"]), sets
        for name, host in (("a", "h0"), ("b", "h1")):
            address = lab.host(host).address
            for port in site.ports_of(name):
                assert lab.connects(None, address, port) == (network == "direct")  # the laptop
                assert lab.connects("h1" if host == "h0" else "h0", address, port)  # the other member
                assert not lab.connects("h2", address, port)  # no member
        assert site.dtf("down").returncode == 0
        assert [every_rule_set(site, h) for h in ("h0", "h1", "h2")] == [[], [], []]  # nothing in nft or iptables
        assert left_by_user(site, SUDO_USER) == ([], [])


def test_a_host_whose_users_sudo_asks_for_a_password_is_warned_about_and_still_works(site: LabSite):
    """firewall: auto on a host whose user's sudo for the rule tools needs a password (sudo -n
    cannot run them): `up` goes on, and says in one line that the host stays open and why.
    firewall: members refuses that host in one line."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    as_user(site, inv, {0: PASSWORD_SUDO_USER})
    why = r"needs root or passwordless sudo for \S+/nft \(sudo -n asks for a password\)"
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and re.fullmatch(
        rf"dtf: warning: firewall: auto could not close the TF ports on h0 \(h0: {why}\): anyone who "
        r"reaches them can run code there; root or passwordless sudo for nft or iptables closes them, firewall: "
        r"members refuses such hosts", warnings[0]), warnings
    assert "closed to non-members (firewall: auto) except on h0" in r.stdout
    for port in site.ports_of("a"):
        assert lab.connects("h2", lab.host("h0").address, port)  # open, as said
        assert lab.connects(None, lab.host("h0").address, port)
    assert not lab.connects("h2", lab.host("h1").address, site.ports_of("b")[0])  # h1's root closed its own
    assert every_rule_set(site, "h0") == []
    assert site.dtf("status").returncode == 0
    assert site.dtf("down").returncode == 0
    assert no_rules(site) and site.files() == [] and left_by_user(site, PASSWORD_SUDO_USER) == ([], [])

    inv.write_text(inv.read_text() + "firewall: members\n")
    r = site.dtf("up", str(inv))
    error = assert_one_line_error(r, 4)
    assert re.search(rf"^  h0: firewall: members is not possible there: {why}$", error, re.M), error
    assert no_rules(site) and site.files() == [] and left_by_user(site, PASSWORD_SUDO_USER) == ([], [])
