"""How the laptop reaches the tasks, and who else may: fake servers (they echo what they get) on
the SSH lab, in seconds. `network: ssh` (chosen by `auto` when only port 22 passes), the proxy that
carries only planned targets, the host-to-host check of `up`, and `firewall: members` (the default
and the others: tests/fake/test_firewall.py).
Real TensorFlow trains through SSH in tests/e2e/test_through_ssh.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts import control
from dtf.hosts.control import host_path
from dtf.hosts.masters import Master
from dtf.hosts.netutil import listen_port
from dtf.hosts.openssh import ssh_binary
from dtf.hosts.proxy import PythonRoute, SharedMaster
from helpers import (
    Interruptible,
    assert_one_line_error,
    fake_server,
    master_path,
    ssh_processes,
    status_json,
    wait_until,
    within,
)
from lab import Lab
from sites import CLUSTER, LabSite

pytestmark = pytest.mark.lab

# `dtf train` runs this: through dtf's proxy (grpc_proxy), each task of TF_CONFIG answers with
# what it was sent; a target that is not a task is refused.
PROBE = textwrap.dedent("""
    import json, os, socket, sys, urllib.parse
    proxy = urllib.parse.urlparse(os.environ["grpc_proxy"])
    print("no_grpc_proxy", os.environ["no_grpc_proxy"])
    def through(target):
        s = socket.create_connection((proxy.hostname, proxy.port), timeout=20)
        s.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
        head = b""
        while not head.endswith(b"\\r\\n\\r\\n"):
            chunk = s.recv(1)
            if not chunk:
                break
            head += chunk
        status = head.split(b"\\r\\n")[0].decode()
        if " 200 " not in status:
            return status
        s.sendall(b"hello " + target.encode())
        return status + " | " + s.recv(100).decode()
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    for target in cluster["ps"] + cluster["worker"] + sys.argv[1:]:
        print(target, "->", through(target), flush=True)
""")


@pytest.fixture
def site(netns_site: LabSite) -> LabSite:
    return netns_site  # every test here needs hosts of their own addresses


def logins(lab: Lab) -> dict[str, int]:
    """SSH logins each sshd of the lab accepted so far (its log, LogLevel VERBOSE)."""
    return {h.name: (lab.root / h.name / "sshd.log").read_text(errors="replace").count("Accepted publickey")
            for h in lab.hosts}


def channels(home: Path) -> list[str]:
    """`ssh -W` channels over the site's control masters (a `dtf train`'s in ssh mode)."""
    prefix, found = str(control.control_dir() / "c"), []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if "-W" in argv and any(a.startswith(prefix) for a in argv) and str(home).encode() in environ:
            found.append(" ".join(argv))
    return found


@pytest.mark.parametrize("carrier, drop", [("openssh", False), ("python", False), ("openssh", True)])
def test_auto_picks_ssh_when_only_port_22_passes_and_the_proxy_carries_only_tasks(
        site: LabSite, tmp_path: Path, carrier: str, drop: bool):
    """`drop`: the laptop's packets to the TF ports go unanswered, not reset (the direct probes are
    not waited out, dtf.providers.route.DIRECT_FIRST)."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    env = {"DTF_SSH": "none"} if carrier == "python" else {}
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    with lab.laptop_blocked(drop=drop):
        assert not lab.connects(None, lab.host("h0").address, site.ports_of("a")[0])
        t0 = time.monotonic()
        r = site.dtf("up", str(inv), env=env)
        up_s = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert "network: ssh; the TF ports are closed to this machine: dtf reaches them through SSH" in r.stdout
        status = status_json(site.home)
        assert status["network"] == "ssh" and [x["state"] for x in status["tasks"]] == ["alive"] * 3
        stranger = f"{lab.host('h2').address}:22"
        before = logins(lab)
        r = site.dtf("train", str(probe), stranger, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        if carrier == "openssh":  # over the cluster's control masters, kept since `up`
            assert logins(lab) == before, (before, logins(lab))
        for host, port in [("h0", p) for p in site.ports_of("a")] + [("h1", p) for p in site.ports_of("b")]:
            target = f"{lab.host(host).address}:{port}"
            assert f"{target} -> HTTP/1.1 200 Connection established | hello {target}" in r.stdout, r.stdout
        assert f"{stranger} -> HTTP/1.1 403 Forbidden" in r.stdout
        assert "no_grpc_proxy localhost,127.0.0.1,::1" in r.stdout
        assert ssh_processes() == [] and channels(site.home) == []  # the proxy and its channels ended with `dtf train`
        t0 = time.monotonic()
        r = site.dtf("down")
        print(f"{carrier}{' (dropped)' if drop else ''}: up {up_s:.1f}s, down {time.monotonic() - t0:.1f}s "
              f"(ssh mode, fake servers)")
        assert r.returncode == 0, r.stderr
    assert site.processes() == [] and site.files() == [] and ssh_processes() == []


def h0_master(site: LabSite) -> Master:
    """The master a `dtf train` in ssh mode opens to h0 (not started)."""
    ssh = ssh_binary()
    assert ssh
    return Master(ssh, h0_spec(site), str(site.lab.ssh_config), master_path(site.home, "fk", "h0"))


def h0_spec(site: LabSite) -> HostSpec:
    return HostSpec(host="h0", line=1, connection="ssh", user=None, port=None,
                    identity_file=str(site.lab.key), python=sys.executable, workdir="~", address=None,
                    ps_ports=(), worker_ports=())


def test_a_command_asked_of_the_master_itself_is_what_ssh_s_own_mux_client_runs(site: LabSite, tmp_path: Path):
    """dtf.hosts.mux: `up`'s launcher call asked of the host's master over its control socket, no
    ssh process per host and command: the command's stdin (the data, then a line later), stdout
    line by line, stderr and exit status are what `ssh -S PATH HOST COMMAND` gives; a session
    ended here ends with -9; a socket that is no master is refused before anything runs."""
    import socket
    import threading

    from dtf.hosts.base import Conversation
    from dtf.hosts.mux import MuxProcess, MuxRefused
    from dtf.hosts.shell import render

    master = h0_master(site)
    master.start()
    try:
        command = render(["sh", "-c", 'head -c 5; echo; read line; echo "got $line"; echo "to stderr" >&2; exit 3'])

        def talk(conv: Conversation) -> tuple[object, ...]:
            first = conv.readline(30)
            conv.send("go")
            second = conv.readline(30)
            r = conv.finish(30)
            return first, second, r.exit_code, r.stdout, r.stderr

        mux = Conversation([], b"hello", proc=MuxProcess(master.path, command))
        assert len(ssh_processes()) == 1  # the master alone: no ssh for the command
        assert talk(mux) == ("hello", "got go", 3, "", "to stderr\n")
        # The same through ssh's own mux client.
        ssh = [master.ssh, "-S", master.path, "-o", "ControlMaster=no", "h0", command]
        assert talk(Conversation(ssh, b"hello")) == ("hello", "got go", 3, "", "to stderr\n")

        # Output still on its way when the exit status comes (more than a pipe holds, none of it
        # read yet): all of it arrives, the connection held until the master closes it.
        lines = 20000
        proc = MuxProcess(master.path, render(["sh", "-c", f"yes 0123456789abcdef | head -n {lines}"]))
        many = Conversation([], b"", proc=proc)
        wait_until(lambda: proc.status is not None, timeout=30)
        assert proc.poll() is None  # (its output is not all out: the master holds the session)
        got = 0
        while many.readline(30) == "0123456789abcdef":
            got += 1
        assert got == lines and many.finish(30).exit_code == 0

        ended = Conversation([], b"", proc=MuxProcess(master.path, render(["sleep", "3600"])))
        assert ended.readline(0.3) is None
        within(60, ended.kill)  # (waiting for the command's end would hang)
        assert ended.proc.returncode == -9
        assert master.alive()  # (the master carries on)

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:  # a socket that is no master
            other.bind(str(tmp_path / "not-a-master"))
            other.listen(1)

            def answer() -> None:
                conn, _ = other.accept()
                with conn:
                    conn.sendall(b"\0\0\0\x08\0\0\0\x01\0\0\0\x03")  # a hello of version 3
                    conn.recv(100)

            threading.Thread(target=answer, daemon=True).start()
            with pytest.raises(MuxRefused, match="another protocol"):
                MuxProcess(str(tmp_path / "not-a-master"), "true")
        with pytest.raises(MuxRefused):
            MuxProcess(str(tmp_path / "nothing-there"), "true")
    finally:
        master.stop()
    assert ssh_processes() == []


def test_down_closes_a_master_a_killed_train_left(site: LabSite, tmp_path: Path):
    """A `dtf train` in ssh mode carries its connections over the cluster's master to each host,
    with its remote forward back to the coordinator added (SharedMaster): killed, it leaves that
    master with the forward; `dtf down` closes it, and nothing of ssh is left."""
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    assert site.dtf("up", str(inv), "--network", "ssh").returncode == 0
    ssh = ssh_binary()
    assert ssh
    master = Master(ssh, h0_spec(site), str(site.lab.ssh_config), host_path(site.home, CLUSTER, "h0"))
    route = SharedMaster(master, listen_port("127.0.0.1"))
    route.ensure()  # as a `dtf train` would have, before it was killed
    assert master.alive()
    assert site.dtf("down").returncode == 0
    assert not master.alive() and ssh_processes() == []


@pytest.mark.parametrize("carrier", ["openssh", "python"])
def test_the_hosts_sshd_sends_replies_without_delay(site: LabSite, carrier: str):
    """An sshd before OpenSSH 10.1 (this lab's is 9.2) turns Nagle's algorithm off only when a
    session starts: without it, a task's reply in two writes waited for the laptop's delayed ACK,
    40 ms per round trip. dtf's connections for the TF ports start one."""
    # (what the tests before left: a master's sshd child exits a moment after its master did)
    wait_until(lambda: site.lab.sshd_nodelay("h0") == [], timeout=30)
    route = h0_master(site) if carrier == "openssh" else PythonRoute(h0_spec(site), str(site.lab.ssh_config), 10)
    try:
        route.ensure()
        assert site.lab.sshd_nodelay("h0") == [True]
    finally:
        route.stop()
    assert ssh_processes() == []


@pytest.mark.parametrize("carrier", ["openssh", "python"])
def test_through_a_jump_host_both_sshds_send_replies_without_delay(site: LabSite, tmp_path: Path, carrier: str):
    """ssh's own ProxyJump connection never has a session, so the jump host's sshd kept Nagle on
    (44 ms per round trip again): dtf opens its own master to the jump host and runs one there."""
    lab = site.lab
    config = tmp_path / "ssh_config"
    config.write_text(f"Host behind-h0\n  HostName {lab.host('h2').address}\n  User root\n  ProxyJump h0\n"
                      f"  UserKnownHostsFile {lab.known_hosts}\n  StrictHostKeyChecking yes\n\n"
                      f"Host h0\n  IdentityFile {lab.key}\n\n" + lab.ssh_config.read_text())
    spec = replace(h0_spec(site), host="behind-h0")
    ssh = ssh_binary()
    assert ssh
    # (what the tests before left: a host may still serve one more connection, on its way out)
    wait_until(lambda: lab.sshd_nodelay("h0") == [] and lab.sshd_nodelay("h2") == [], timeout=30)
    route = (Master(ssh, spec, str(config), master_path(site.home, "fk", "behind-h0")) if carrier == "openssh"
             else PythonRoute(spec, str(config), 10))
    try:
        route.ensure()
        assert (lab.sshd_nodelay("h0"), lab.sshd_nodelay("h2")) == ([True], [True])
    finally:
        route.stop()
    assert ssh_processes() == []  # the jump host's master went with the host's


def test_up_refuses_hosts_that_cannot_reach_each_other_naming_the_pair(site: LabSite):
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    ps = site.ports_of("a")[0]
    # h1 cannot open connections to h0's ps port (h0 and the laptop can).
    lab.nft("h1", f"table inet dtfblock {{\n chain out {{\n  type filter hook output priority 0;\n"
                  f"  ip daddr {lab.host('h0').address} tcp dport {ps} reject with tcp reset\n }}\n}}\n")
    try:
        r = site.dtf("up", str(inv))
    finally:
        lab.run("h1", ["nft", "delete", "table", "inet", "dtfblock"])
    assert r.returncode != 0
    error = r.stderr[r.stderr.index("dtf: error:"):].strip().splitlines()
    assert error == ["dtf: error: dtf up failed on 1 host(s):",
                     f"  h1: cannot reach ps:0 at {lab.host('h0').address}:{ps} (on h0): Connection refused"]
    assert site.processes() == [] and site.files() == []  # rolled back


def test_firewall_members_closes_the_tf_ports_to_everyone_else_until_down(site: LabSite):
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    doc = inv.read_text() + "firewall: members\n"
    inv.write_text(doc)
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert "closed to non-members (firewall: members)" in r.stdout
    assert status_json(site.home)["network"] == "ssh"  # auto: the laptop is no member
    a, b = lab.host("h0").address, lab.host("h1").address
    for port in site.ports_of("a"):
        assert lab.connects("h1", a, port)  # a member
        assert lab.connects("h0", "127.0.0.1", port)  # loopback
        assert not lab.connects("h2", a, port)  # not a member
        assert not lab.connects(None, a, port)  # the laptop
    assert not lab.connects("h2", b, site.ports_of("b")[0])
    assert any(t.startswith("inet dtf_") for t in lab.tables("h0"))
    assert site.dtf("down").returncode == 0
    assert not any(t.startswith("inet dtf_") for t in lab.tables("h0") + lab.tables("h1"))
    assert lab.connects("h2", a, site.ports_of("a")[0]) is False  # nothing listens: and no rule left


def test_firewall_rules_go_when_the_lease_lapses(site: LabSite):
    """The default's rules (`firewall: auto`, on hosts where dtf is root) go with the last task."""
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    # The rules are seen while the start holds the lease (servers that serve only once released),
    # not in the lease's 6 s after `up` (a busy machine could look too late).
    release = site.tmp / "release"
    up = Interruptible("up", str(inv), "--ttl", "6", env=site.env({"DTF_SERVER": f"fake:ready_file={release}"}))
    try:
        up.wait_for("starting ")
        wait_until(lambda: len([p for p in site.processes() if fake_server(*p)]) == 2, timeout=60)
        assert any(t.startswith("inet dtf_") for t in site.lab.tables("h0"))
    finally:
        release.write_text("")
    code, err = up.finish(timeout=120)
    assert code == 0, err
    deadline = time.monotonic() + 30
    while any(t.startswith("inet dtf_") for t in site.lab.tables("h0")) or site.files() or site.processes():
        assert time.monotonic() < deadline, (site.lab.tables("h0"), site.files(), site.processes())
        time.sleep(0.2)


def python_with(tmp_path: Path, tools: str) -> str:
    """A python for the inventory whose launcher tries only these firewall tools."""
    wrapper = tmp_path / f"python-{tools}"
    wrapper.write_text(f"#!/bin/sh\nDTF_FIREWALL_TOOLS={tools} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_firewall_members_where_it_cannot_be_done_is_one_line(site: LabSite, tmp_path: Path):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}}, python=python_with(tmp_path, "none"))
    inv.write_text(inv.read_text() + "firewall: members\n")
    r = site.dtf("up", str(inv))
    assert r.returncode != 0
    error = r.stderr[r.stderr.index("dtf: error:"):].strip().splitlines()
    assert error == ["dtf: error: dtf up failed on 1 host(s):",
                     "  h0: firewall: members is not possible there: neither nft nor iptables is installed"]
    assert site.processes() == [] and site.files() == []


def test_firewall_members_with_iptables(site: LabSite, tmp_path: Path):
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}}, python=python_with(tmp_path, "iptables"))
    inv.write_text(inv.read_text() + "firewall: members\n")
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    port = site.ports_of("a")[0]
    assert not lab.connects("h2", lab.host("h0").address, port)
    assert lab.connects("h0", lab.host("h0").address, port)  # the host itself is a member
    assert "DTF-" in lab.run("h0", ["iptables", "-S"]).stdout
    assert site.dtf("down").returncode == 0
    assert "DTF-" not in lab.run("h0", ["iptables", "-S"]).stdout


def test_status_json_names_the_network(site: LabSite):
    inv = site.inventory({"a": {"ps": 1, "workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    s = status_json(site.home)
    assert (s["network"], s["firewall"]) == ("direct", "auto")
    r = site.dtf("status")
    assert "network: direct, firewall: auto" in r.stdout
    assert json.loads(site.record().read_text())["network"] == "direct"


def cluster_masters(home: Path) -> list[str]:
    """The ssh processes of the site's cluster masters (in their handshake, or running)."""
    prefix, found = control.cluster_prefix(home, CLUSTER), []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (Path(argv[0]).name == "ssh" or argv[0].startswith("ssh: ")) and any(prefix in a for a in argv):
            found.append(" ".join(argv))
    return found


def test_ctrl_c_as_soon_as_the_hosts_masters_run_leaves_nothing(site: LabSite, tmp_path: Path):
    """A Ctrl-C as soon as `up`'s masters to its hosts run leaves nothing: no master, task or file
    (the servers never serve before the test releases them: the `up` cannot end first). The next
    `up` logs in once per host."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    release = tmp_path / "release"
    up = Interruptible("up", str(inv), env=site.env({"DTF_SERVER": f"fake:ready_file={release}"}))
    try:
        wait_until(lambda: len(cluster_masters(site.home)) >= 2, timeout=60, every=0.002)
        up.ctrl_c()
    finally:
        release.write_text("")
    code, err = up.finish()
    assert code == 130 and "Traceback" not in err, err
    wait_until(lambda: cluster_masters(site.home) == [], timeout=15)
    assert site.processes() == [] and site.files() == [] and not site.record().exists()

    before = logins(lab)
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    after = logins(lab)
    assert {h: after[h] - before[h] for h in ("h0", "h1")} == {"h0": 1, "h1": 1}
    assert site.dtf("down").returncode == 0
    assert site.processes() == [] and cluster_masters(site.home) == []


def commands_run(lab: Lab) -> dict[str, int]:
    """Commands each sshd of the lab ran so far (sessions over the masters; LogLevel VERBOSE)."""
    return {h.name: (lab.root / h.name / "sshd.log").read_text(errors="replace").count("Starting session: command")
            for h in lab.hosts}


@pytest.mark.parametrize("busy", [False, True])
def test_hosts_taken_in_turns_check_the_mesh_in_their_one_launcher_call_once_told(site: LabSite, busy: bool):
    """One host at a time (DTF_TURNS=1): each host's start ends its turn once its servers serve,
    and checks that it reaches the other hosts' tasks once `up` tells it every host's serve: one
    command per host, no separate round of mesh checks. A host that fails its start (a busy
    port) has the others told to skip the check: its line, the rest rolled back, nothing left."""
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    before = commands_run(lab)
    with site.hold_port("b", site.ports_of("b")[0]) if busy else contextlib.nullcontext():
        r = site.dtf("up", str(inv), env={"DTF_TURNS": "1"})
    if busy:
        assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", f"h1: port busy: {site.ports_of('b')[0]}")
        assert site.processes() == [] and site.files() == [] and not site.record().exists()
        return
    assert r.returncode == 0, r.stderr
    after = commands_run(lab)
    assert {h: after[h] - before[h] for h in ("h0", "h1")} == {"h0": 1, "h1": 1}
    assert [t["state"] for t in status_json(site.home)["tasks"]] == ["alive"] * 3
    assert site.dtf("down").returncode == 0
    assert site.processes() == [] and site.files() == []
