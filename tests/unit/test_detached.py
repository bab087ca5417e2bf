"""Detached runs' pure parts (no hosts, no TensorFlow): the cluster as the coordinator's host sees
it, its ssh_config, the choice of that host, what the program imports, where laptop paths land,
the cluster key's line in authorized_keys and its removal, the attach printer's cursor (each line
once), the tail of the run's output, and the moves the coordinator made, adopted here."""

from __future__ import annotations

import dataclasses
import io
import json
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.cluster.state import DetachedRun, Record
from dtf.detached import attach, start, vantage
from dtf.detached.remote import adopt
from dtf.errors import InventoryError
from dtf_server import sshkeys
from dtf_server.program import tail_offset
from dtf_server.protocol import DetachedReply, Lease

INVENTORY = """cluster: c
hosts:
  - {host: h0, workers: 1, user: alice, port: 2201, identity_file: ~/.ssh/id}
  - {host: h1, ps: 1, address: 10.0.0.11}
  - {host: h2, workers: 1, address: 10.0.0.12}
spares:
  - {host: h3, address: 10.0.0.13}
"""


def plan_of(text: str = INVENTORY) -> Any:
    return make_plan(loads(text, "inventory.yaml"))


def record_of(plan: Any) -> Record:
    return Record(plan=plan, inventory="inventory.yaml", created=1.0, chief_host="192.0.2.1", network="ssh",
                  detached=DetachedRun(run_id="r", host="h1", program="p.py", started=1.0, cwd="/w"))


HOSTS = {"h0": vantage.HostSsh("alice", 2201, ("ssh-ed25519 AAAA0",)),
         "h2": vantage.HostSsh("root", 22, ("ssh-ed25519 AAAA2",)),
         "h3": vantage.HostSsh("root", 22, ())}


def test_the_coordinator_runs_on_the_first_ps_host_unless_the_inventory_names_one() -> None:
    assert vantage.coordinator_host(plan_of()).name == "h1"
    named = plan_of(INVENTORY.replace("cluster: c\n", "cluster: c\ncoordinator: H2\n"))
    assert named.coordinator == "h2" and vantage.coordinator_host(named).name == "h2"
    with pytest.raises(InventoryError, match=r"inventory.yaml:2:\d+: coordinator: 'h3' is not one of the hosts"):
        plan_of(INVENTORY.replace("cluster: c\n", "cluster: c\ncoordinator: h3\n"))


def test_seen_from_the_coordinators_host_it_is_local_and_the_others_are_reached_with_the_runs_ssh_config() -> None:
    seen = vantage.vantage(record_of(plan_of()), "h1", "/home/u/.dtf/c/detached")
    plan = seen.plan
    spec = {hp.name: hp.spec for hp in (*plan.hosts, *plan.spares)}
    assert spec["h1"].connection == "local"
    assert (spec["h0"].connection, spec["h0"].user, spec["h0"].port, spec["h0"].identity_file) == ("ssh", None, None,
                                                                                                   None)
    assert plan.ssh_config == "/home/u/.dtf/c/detached/ssh/config"
    assert (seen.network, plan.network, seen.chief_host, seen.detached) == ("direct", "direct", "10.0.0.11", None)
    assert plan.tasks() == plan_of().tasks()  # the same cluster: only how it is reached differs


def test_the_runs_ssh_config_names_every_other_host_with_the_key_and_only_the_host_keys_they_showed() -> None:
    plan = vantage.vantage(record_of(plan_of()), "h1", "/r").plan
    text = vantage.ssh_config(plan, "h1", "/r", HOSTS)
    blocks = {b.split("\n")[0]: b for b in text.split("\n\n")}
    assert sorted(blocks) == ["Host h0", "Host h2", "Host h3"]
    h0 = blocks["Host h0"]
    for line in ("HostName h0", "Port 2201", "User alice", "IdentityFile /r/ssh/key", "IdentitiesOnly yes",
                 "HostKeyAlias dtf-h0", "UserKnownHostsFile /r/ssh/known_hosts", "StrictHostKeyChecking yes",
                 "BatchMode yes", "ForwardAgent no", "GlobalKnownHostsFile /dev/null"):
        assert f"  {line}\n" in h0 + "\n", (line, h0)
    assert "HostName 10.0.0.13" in blocks["Host h3"] and "StrictHostKeyChecking accept-new" in blocks["Host h3"]
    assert vantage.known_hosts(HOSTS) == "dtf-h0 ssh-ed25519 AAAA0\ndtf-h2 ssh-ed25519 AAAA2\n"


def test_seen_from_a_slurm_node_the_login_host_is_the_node_itself() -> None:
    plan = plan_of("cluster: c\nhosts:\n  - {host: n1, ps: 1, workers: 1}\n  - {host: n2, workers: 1}\n")
    login = dataclasses.replace(plan.hosts[0].spec, host="login", connection="ssh")
    allocation = Allocation(job="7", submitted=True, login=login, nodes=("n1", "n2"), addresses=("10.1.0.1", "10.1.0.2"))
    plan = dataclasses.replace(plan, hosts=tuple(dataclasses.replace(hp, spec=dataclasses.replace(
        hp.spec, connection="slurm")) for hp in plan.hosts), allocation=allocation)
    seen = vantage.vantage(record_of(plan), "n1", "/r").plan
    assert seen.allocation is not None and seen.allocation.login.connection == "local"
    assert seen.ssh_config is None  # no SSH host to reach: Slurm's job steps reach the nodes


def test_what_the_program_imports_less_the_standard_library_and_its_own_modules(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("")
    (tmp_path / "pkg").mkdir()
    program = tmp_path / "p.py"
    program.write_text("import os, numpy as np\nfrom pandas.io import x\nimport helper\nfrom pkg import y\n"
                       "from . import z\nimport dtf\ndef f():\n    import sklearn.linear_model\n")
    assert start.program_imports(program) == ["numpy", "pandas", "sklearn"]
    (tmp_path / "bad.py").write_text("def (:\n")
    assert start.program_imports(tmp_path / "bad.py") == []


def test_laptop_paths_below_the_working_directory_keep_their_place_in_the_runs_work(tmp_path: Path) -> None:
    assert start.placed(tmp_path / "a" / "b", tmp_path, "elsewhere") == "work/a/b"
    assert start.placed(tmp_path, tmp_path, "elsewhere") == "work"
    assert start.placed(Path("/somewhere/else"), tmp_path, "output") == "output"


def test_a_program_folder_above_the_limit_is_refused_with_its_size_and_largest_files(tmp_path: Path) -> None:
    (tmp_path / "p.py").write_text("print(1)\n")
    (tmp_path / "big.bin").write_bytes(b"x" * 3000)
    (tmp_path / ".gitignore").write_text("ignored.bin\n")
    (tmp_path / "ignored.bin").write_bytes(b"x" * 10**6)
    with pytest.raises(Exception, match=r"holds 0.0 MB to send, more than 0.0 MB \(largest: big.bin"):
        start.pack_program(tmp_path / "p.py", limit=2000)
    assert start.pack_program(tmp_path / "p.py", limit=10**5).synced.files == 3  # .gitignore applies


@pytest.fixture
def ssh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_key_line_lets_in_as_little_as_openssh_allows() -> None:
    line = sshkeys.key_line("ssh-ed25519 AAAAC3", ["10.0.0.11"], time.mktime((2026, 11, 29, 15, 30, 0, 0, 0, -1)), "t1")
    assert line == 'restrict,from="10.0.0.11",expiry-time="202611291530" ssh-ed25519 AAAAC3 dtf-coordinator:t1'
    assert sshkeys.key_line("ssh-ed25519 AAAAC3", [], None, "t1") == "restrict ssh-ed25519 AAAAC3 dtf-coordinator:t1"
    assert sshkeys.allowed(["127.0.2.11", "10.0.0.1"]) == ["127.0.2.11", "10.0.0.1", "127.0.0.1", "::1"]
    assert sshkeys.KEY.match("ssh-ed25519 AAAAC3Nza+/=") and not sshkeys.KEY.match('ssh-ed25519 AA" x')


def test_the_users_other_lines_stay_as_they_were_and_only_dtfs_line_goes(ssh_home: Path) -> None:
    keys = ssh_home / ".ssh" / "authorized_keys"
    keys.parent.mkdir(mode=0o700)
    keys.write_text("ssh-ed25519 AAAAuser me@laptop\n# a comment\nssh-rsa AAAAother")  # no final newline
    keys.chmod(0o640)
    root = ssh_home / "root"
    root.mkdir()
    (root / "lease.json").write_text(json.dumps({"ttl": 3600, "renewed": time.time()}))
    from dtf_server.detached import cmd_authorize
    from dtf_server.protocol import AuthorizeRequest

    reply = cmd_authorize(AuthorizeRequest(dir=str(root), key="ssh-ed25519 AAAAC3", allow=["10.0.0.11"]))
    assert reply.error is None and reply.user
    lines = keys.read_text().splitlines()
    assert lines[:3] == ["ssh-ed25519 AAAAuser me@laptop", "# a comment", "ssh-rsa AAAAother"]
    assert lines[3].startswith('restrict,from="10.0.0.11",expiry-time="') and len(lines) == 4
    assert stat.S_IMODE(keys.stat().st_mode) == 0o640
    assert sshkeys.deauthorize(str(root)) is None
    assert keys.read_text() == "ssh-ed25519 AAAAuser me@laptop\n# a comment\nssh-rsa AAAAother\n"
    assert not (root / "authorized.json").exists() and sshkeys.deauthorize(str(root)) is None


def test_a_file_dtf_made_goes_with_its_line_and_the_expiry_follows_the_lease(ssh_home: Path) -> None:
    root = ssh_home / "root"
    root.mkdir()
    from dtf_server.detached import cmd_authorize
    from dtf_server.protocol import AuthorizeRequest

    cmd_authorize(AuthorizeRequest(dir=str(root), key="ssh-ed25519 AAAAC3", allow=["10.0.0.11"]))
    keys = ssh_home / ".ssh" / "authorized_keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600 and stat.S_IMODE(keys.parent.stat().st_mode) == 0o700
    first = keys.read_text()
    sshkeys.refresh(str(root), Lease(ttl=3600, renewed=time.time()))  # fresh: not rewritten
    assert keys.read_text() == first
    sshkeys.refresh(str(root), Lease(ttl=3600, renewed=time.time() + 86400))  # a day on: rewritten
    assert keys.read_text() != first and keys.read_text().count("dtf-coordinator:") == 1
    sshkeys.deauthorize(str(root))
    assert not keys.exists()


def test_the_tail_of_the_runs_output_starts_at_a_lines_beginning() -> None:
    for data, n, tail in [(b"a\nb\nc\n", 2, b"b\nc\n"), (b"a\nb\nc", 2, b"b\nc"), (b"a\nb\n", 0, b""),
                          (b"a\nb\n", 9, b"a\nb\n"), (b"", 3, b""), (b"\n\n", 1, b"\n")]:
        f = io.BytesIO(data)
        assert data[tail_offset(f, n):] == tail, (data, n)


def test_the_printer_prints_whole_lines_once_and_saves_its_cursor_after_each(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTF_HOME", str(tmp_path))
    out = io.BytesIO()
    printer = attach.Printer("c", "run1", 0, out)
    printer.feed(b"one\ntw", lambda: False)
    assert out.getvalue() == b"one\n" and attach.read_cursor(tmp_path, "c", "run1") == 4
    with pytest.raises(attach.Interrupted):
        printer.feed(b"o\nthree\n", lambda: True)  # Ctrl-C: acted on before the next line
    assert out.getvalue() == b"one\n" and attach.read_cursor(tmp_path, "c", "run1") == 4
    printer = attach.Printer("c", "run1", attach.read_cursor(tmp_path, "c", "run1"), out)
    printer.feed(b"two\nthree\nfou", lambda: False)
    printer.finish()
    assert out.getvalue() == b"one\ntwo\nthree\nfou\n" and printer.offset == 17
    assert attach.read_cursor(tmp_path, "c", "run1") == 17 and attach.read_cursor(tmp_path, "c", "run2") == 0


def test_the_moves_the_coordinator_made_are_adopted_here() -> None:
    plan = plan_of()
    reply = DetachedReply(state="ended", run_id="r", placement={"h0": ["worker:0"], "h1": ["ps:0"],
                                                                "h3": ["worker:1"]}, retired=["h2"])
    moved = adopt(plan, reply)
    assert [(t.name, t.host) for t in moved.tasks()] == [("ps:0", "h1"), ("worker:0", "h0"), ("worker:1", "h3")]
    assert [hp.name for hp in moved.retired] == ["h2"] and moved.spares == ()
    cleaned = adopt(plan, dataclasses.replace(reply, retired=[]))
    assert cleaned.retired == () and [t.host for t in cleaned.tasks()] == ["h1", "h0", "h3"]
    assert adopt(plan, DetachedReply(state="ended")) == plan


def test_the_record_keeps_the_detached_run() -> None:
    record = record_of(plan_of())
    assert Record.from_dict(record.to_dict()) == record
    data = record.to_dict()
    del data["detached"]
    assert Record.from_dict(data).detached is None  # a record written before detached runs

