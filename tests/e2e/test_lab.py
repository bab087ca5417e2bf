"""Tests of the SSH lab itself (tests/lab.py): if these fail, every end-to-end test is suspect."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
import yaml

from lab import PASSWORD_SUDO_USER, PRIVATE, SUDO_USER, USERS, Host, Lab, LabError, LabUnsupported, _alive

pytestmark = [pytest.mark.lab, pytest.mark.tf]

FAKE_PYTHON = Path(__file__).resolve().parents[1] / "fakes" / "python-tf-mismatch"
VERSIONS = "import importlib.metadata as m; print(m.version('tensorflow'), m.version('tensorflow-cpu'))"


def connect(lab: Lab, alias: str, key: Path | None = None) -> paramiko.SSHClient:
    """Connect the way dtf does: everything but the key comes from the lab's ssh_config."""
    cfg = paramiko.SSHConfig.from_path(str(lab.ssh_config)).lookup(alias)
    client = paramiko.SSHClient()
    client.load_host_keys(cfg["userknownhostsfile"])
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(cfg["hostname"], port=int(cfg["port"]), username=cfg["user"],
                       key_filename=str(key or lab.key), look_for_keys=False, allow_agent=False,
                       timeout=5, banner_timeout=5, auth_timeout=5)
    except BaseException:
        client.close()  # a refused login's connection, else left open by paramiko's thread
        raise
    return client


def ssh_run(lab: Lab, alias: str, command: str) -> tuple[int, str]:
    with connect(lab, alias) as client:
        _, out, err = client.exec_command(command, timeout=60)
        text = out.read().decode() + err.read().decode()
        return out.channel.recv_exit_status(), text


def refused_or_unreachable(address: str, port: int, timeout: float) -> bool:
    """Whether a TCP connect to address:port is refused or finds no route (an answer), rather than
    left unanswered until `timeout`; fails the test if it connects."""
    with pytest.raises(OSError) as failed:
        socket.create_connection((address, port), timeout=timeout).close()
    return not isinstance(failed.value, TimeoutError)


def test_every_host_answers_ssh_with_the_lab_key(lab: Lab) -> None:
    for h in lab.hosts:
        status, text = ssh_run(lab, h.name, "id -un; echo $HOME")
        assert status == 0 and text.split()[0] == "root", text


def test_openssh_client_works_with_ssh_config_and_known_hosts(lab: Lab) -> None:
    r = subprocess.run(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes",
                        lab.hosts[-1].name, "echo ok"], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, "ok\n"), r.stderr


def test_wrong_key_is_refused(lab: Lab) -> None:
    with pytest.raises(paramiko.AuthenticationException):
        connect(lab, "h0", key=lab.wrong_key)


def test_sftp_upload_into_the_host_workdir(lab: Lab) -> None:
    h = lab.hosts[0]
    with connect(lab, h.name) as client, client.open_sftp() as sftp:
        sftp.putfo(io.BytesIO(b"hello"), f"{h.workdir}/sftp-probe")
    assert Path(h.workdir, "sftp-probe").read_bytes() == b"hello"


def test_hosts_have_distinct_addresses_and_workdirs(lab: Lab) -> None:
    assert len({h.address for h in lab.hosts}) == len({h.workdir for h in lab.hosts}) == 3
    assert all(Path(h.workdir).is_dir() and Path(h.workdir).is_relative_to(lab.root) for h in lab.hosts)
    assert lab.unused_address not in {h.address for h in lab.hosts}


def test_commands_run_in_the_right_namespace(lab: Lab) -> None:
    if lab.mode != "netns":
        pytest.skip("loopback mode: hosts share the root namespace")
    seen = {os.readlink("/proc/self/ns/net")}
    for h in lab.hosts:
        ns = lab.run(h, ["readlink", "/proc/self/ns/net"], timeout=10).stdout.strip()
        assert ns and ns not in seen
        seen.add(ns)
        addrs = lab.run(h.name, ["ip", "-4", "-o", "addr", "show"], timeout=10).stdout
        assert f" {h.address}/24 " in addrs
        assert all(f" {o.address}/" not in addrs for o in lab.hosts if o is not h)
        status, text = ssh_run(lab, h.name, "readlink /proc/self/ns/net")
        assert (status, text.strip()) == (0, ns)


def test_link_down_cuts_the_host_off_and_link_up_restores_it(lab: Lab) -> None:
    h, other = lab.hosts[1], lab.hosts[0]
    if lab.mode != "netns":
        with pytest.raises(LabUnsupported):
            lab.link_down(h)
        pytest.skip("loopback mode has no links to cut")
    probe = f"import socket; socket.create_connection(('{h.address}', 22), timeout=2).close()"
    lab.link_down(h)
    try:
        refused_or_unreachable(h.address, 22, timeout=2)
        assert lab.run(other, [sys.executable, "-c", probe], timeout=10).returncode != 0
    finally:
        lab.link_up(h)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection((h.address, 22), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "host did not come back after link_up"
            time.sleep(0.05)
    assert lab.run(other, [sys.executable, "-c", probe], timeout=10).returncode == 0
    assert ssh_run(lab, h.name, "true")[0] == 0


def test_unused_address_fails_fast(lab: Lab) -> None:
    assert refused_or_unreachable(lab.unused_address, lab.unused_port, timeout=60)
    cfg = paramiko.SSHConfig.from_path(str(lab.ssh_config)).lookup("unreachable")
    assert cfg["hostname"] == lab.unused_address


def test_ports_are_distinct_and_free_everywhere(lab: Lab) -> None:
    a, b = lab.ports(4), lab.ports(3)
    assert len(set(a + b)) == 7
    check = f"import socket\nfor p in {a + b}: socket.socket().bind(('0.0.0.0', p))"
    for h in lab.hosts:
        r = lab.run(h, [sys.executable, "-c", check], timeout=30)
        assert r.returncode == 0, r.stderr
    assert 22 not in a + b


def test_inventory_is_written_with_lab_defaults(lab: Lab, tmp_path: Path) -> None:
    path = lab.inventory(tmp_path / "inv.yaml", [{"host": "h0", "ps": [2222]},
                                                 {"host": "h1", "workers": 2, "workdir": "/x"}],
                         cluster="c1", python="/usr/bin/python3")
    doc = yaml.safe_load(path.read_text())
    assert doc["cluster"] == "c1" and doc["ssh_config"] == str(lab.ssh_config)
    assert doc["defaults"] == {"identity_file": str(lab.key), "python": "/usr/bin/python3"}
    assert doc["hosts"] == [{"host": "h0", "ps": [2222], "workdir": lab.hosts[0].workdir},
                            {"host": "h1", "workers": 2, "workdir": "/x"}]


def test_processes_finds_what_mentions_a_workdir(lab: Lab) -> None:
    h = lab.hosts[2]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", h.workdir])
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd (its cmdline changes then)
        while not lab.processes(h) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [pid for pid, _ in lab.processes(h)] == [proc.pid]
        assert lab.processes(lab.hosts[0]) == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert lab.processes(h.workdir) == []


def test_fake_python_reports_tensorflow_2_0_0_over_ssh(lab: Lab) -> None:
    status, text = ssh_run(lab, "h1", f"{FAKE_PYTHON} -c \"{VERSIONS}\"")
    assert (status, text) == (0, "2.0.0 2.0.0\n")
    status, text = ssh_run(lab, "h1", f"{sys.executable} -c \"{VERSIONS}\"")
    assert status == 0 and "2.0.0" not in text, text
    status, text = ssh_run(lab, "h1", f"{FAKE_PYTHON} -c 'import sys; print(sys.argv[1:])' a 'b c'")
    assert (status, text) == (0, "['a', 'b c']\n")


def _lab_pids(lab: Lab) -> list[int]:
    return [h.proc.pid for h in lab.hosts if h.proc is not None]


def _gone(pids: list[int]) -> bool:
    return not any(_alive(p) for p in pids)


def _netns_left(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return [w for w in (out + links).replace(":", " ").replace("@", " ").split() if w.startswith(name)]


def test_exit_cleans_up_even_on_keyboard_interrupt(lab: Lab, tmp_path: Path) -> None:
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    # A second lab beside the session's, on a free identity (another test run may hold others).
    with pytest.raises(KeyboardInterrupt), Lab(2, root=tmp_path, mode="netns", pick=True) as other:
        assert (other.name, other.subnet) != (lab.name, lab.subnet)
        pids = _lab_pids(other)
        assert len(pids) == 2 and not _gone(pids)
        assert ssh_run(other, "h1", "true")[0] == 0
        raise KeyboardInterrupt
    assert _gone(pids) and _netns_left(other.name + "-") == [] and _netns_left(other.bridge) == []
    assert f"{other.subnet}." not in subprocess.run(["ip", "route"], capture_output=True, text=True,
                                                    timeout=10).stdout
    other.close()  # idempotent


def test_cleanup_stale_removes_a_crashed_labs_namespaces(lab: Lab, tmp_path: Path) -> None:
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    crashed = Lab(2, root=tmp_path, mode="netns", pick=True).__enter__()
    try:
        pids = _lab_pids(crashed)
        crashed._lock.close()  # as if its process had died: nobody holds its lock any more
        crashed._lock = None
        Lab.cleanup_stale()
        assert _netns_left(crashed.name + "-") == [] and _netns_left(crashed.bridge) == []
        deadline = time.monotonic() + 10
        while not _gone(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pids)
        assert ssh_run(lab, "h0", "true")[0] == 0  # the live lab was left alone
    finally:
        crashed.close()


def test_a_second_lab_with_the_same_name_is_refused_and_harms_nothing(lab: Lab, tmp_path: Path) -> None:
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    with pytest.raises(LabError, match="another lab"), Lab(1, root=tmp_path, mode="netns"):
        pass
    assert ssh_run(lab, "h0", "true")[0] == 0


def test_loopback_mode_when_port_22_is_taken(lab: Lab, tmp_path: Path) -> None:
    # On the loopback addresses of the session lab's identity (127.0.X.*, X its subnet's third
    # number): no other test run uses them, and the session's lab neither when it is in netns.
    if lab.mode != "netns":
        pytest.skip("the session's lab already runs on these loopback addresses")
    base = f"127.0.{lab.subnet.rsplit('.', 1)[1]}"
    blocker = socket.socket()
    blocker.bind((f"{base}.11", 22))  # h0 must move to another port; h1 keeps 22
    try:
        with Lab(2, root=tmp_path, mode="loopback", name=lab.name, subnet=lab.subnet) as lo:
            assert lo.mode == "loopback"
            h0, h1 = lo.hosts
            assert (h0.address, h1.address, h1.port) == (f"{base}.11", f"{base}.12", 22)
            assert h0.port != 22 and f"[{base}.11]:{h0.port} " in lo.known_hosts.read_text()
            for h in lo.hosts:
                assert h.netns is None and ssh_run(lo, h.name, "echo hi") == (0, "hi\n")
            r = subprocess.run(["ssh", "-F", str(lo.ssh_config), "-i", str(lo.key), "-o", "BatchMode=yes",
                                "h0", "true"], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            assert refused_or_unreachable(lo.unused_address, lo.unused_port, timeout=60)
            assert lo.run(h0, ["true"], timeout=5).returncode == 0
            pids = _lab_pids(lo)
    finally:
        blocker.close()
    assert _gone(pids)


def test_host_objects_expose_the_documented_fields(lab: Lab) -> None:
    h: Host = lab.hosts[0]
    assert h.name == "h0" and h.workdir.endswith("/h0/home/dtf")
    assert (h.netns is None) == (lab.mode == "loopback")
    assert lab.key.exists() and lab.wrong_key.exists() and lab.known_hosts.exists()


def test_the_hosts_non_root_users_and_their_sudo_exist_on_the_hosts_only(lab: Lab) -> None:
    """Each lab host has SUDO_USER (sudo runs nft without a password) and PASSWORD_SUDO_USER
    (sudo asks for one, and -n refuses); this machine's own /etc knows neither user."""
    etc = Path("/etc/passwd").read_text() + Path("/etc/group").read_text()
    assert not any(line.split(":")[0] in USERS for line in etc.splitlines())
    nft = shutil.which("nft")
    for h in (lab.hosts[0], lab.hosts[-1]):
        for user, sudo in ((SUDO_USER, 0), (PASSWORD_SUDO_USER, 1)):
            r = subprocess.run(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes",
                                "-l", user, h.name, f"id -u; echo $HOME; sudo -k -n {nft} list tables >/dev/null; echo $?"],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == [str(lab.uids[user]), lab.home(h, user), str(sudo)], r.stdout
            assert sudo == 0 or "a password is required" in r.stderr, r.stderr
    assert not Path(lab.home(lab.hosts[0], SUDO_USER)).exists()  # (in the host's own PRIVATE)


# Run in a mount namespace whose /etc is a copy on a tmpfs (this machine's own is never touched):
# a lab of one host; its users log in; an account is added as useradd, a package's install script
# and systemd-sysusers add one (/etc/passwd written beside, then renamed over the old); and again.
_ACCOUNT_ADDED = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from lab import USERS, Lab

def logins(lab):
    return {u: subprocess.run(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), "-o", "BatchMode=yes", "-l", u,
                               "h0", "true"], capture_output=True, text=True, timeout=60).stderr.strip()
            for u in ("root", *USERS)}

with Lab(1, root=sys.argv[2], mode="netns", pick=True) as lab:
    before = logins(lab)
    text = open("/etc/passwd").read() + "dtfadded:x:2999:2999:added meanwhile:/nonexistent:/usr/sbin/nologin\\n"
    with open("/etc/passwd+", "w") as f:
        f.write(text)
    os.chmod("/etc/passwd+", 0o644)
    os.rename("/etc/passwd+", "/etc/passwd")
    print(json.dumps({"before": before, "after": logins(lab), "added": "dtfadded:" in open("/etc/passwd").read()}))
"""


def test_the_hosts_users_still_log_in_after_an_account_is_added_on_this_machine(lab: Lab, tmp_path: Path) -> None:
    """The machine replaces /etc/passwd by a rename when an account is added (a package installed
    meanwhile, another person's useradd); a lab host's /etc/passwd must stay the lab's copy with
    its users (a file bound over the machine's was dropped by the kernel then, in every
    namespace: the users' logins were refused for the rest of the run, root's were not)."""
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    etc = tmp_path / "etc"
    etc.mkdir()
    at = shlex.quote(str(etc))
    own_etc = f'mount -t tmpfs -o mode=0755 dtflab-test-etc {at} && cp -a /etc/. {at}/ && mount --bind {at} /etc && exec "$@"'
    tests = Path(__file__).resolve().parents[1]
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", own_etc, "sh",
                        sys.executable, "-c", _ACCOUNT_ADDED, str(tests), str(tmp_path / "lab")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["added"]  # (in the namespace's /etc)
    assert seen["before"] == seen["after"] == {"root": "", SUDO_USER: "", PASSWORD_SUDO_USER: ""}, seen
    assert "dtfadded" not in Path("/etc/passwd").read_text()


def test_each_host_has_a_private_disk_the_laptop_does_not_see(lab: Lab) -> None:
    laptop = lab.laptop_dir("private-check")
    (laptop / "mine").write_text("laptop")
    h0, h1 = lab.hosts[0], lab.hosts[1]
    assert not lab.exists(h0, laptop / "mine")
    assert ssh_run(lab, "h0", f"mkdir -p {PRIVATE}/x && echo h0 > {PRIVATE}/x/f && cat {PRIVATE}/x/f") == (0, "h0\n")
    assert lab.exists(h0, f"{PRIVATE}/x/f") and not lab.exists(h1, f"{PRIVATE}/x/f")
    assert not Path(f"{PRIVATE}/x/f").exists()
    assert lab.exists(h0, h0.workdir)  # the rest of the filesystem is shared
    assert lab.run(h0, ["rm", "-r", f"{PRIVATE}/x"]).returncode == 0  # later tests expect an empty /srv
