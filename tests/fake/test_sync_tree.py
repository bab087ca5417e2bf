"""`dtf sync` to many hosts sends the data once from the laptop: the hosts pass it on to each other
(a tree, dtf.files.relay), on a lab of 8 SSH hosts with fake servers. The laptop's bytes are
counted on the lab's bridge (Lab.laptop_bytes); the trees are checked file by file, by sha256,
on every host. One cluster is shared by the tests of this module (each syncs data of its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dtf.errors import ExitCode
from dtf.files import sync
from helpers import assert_one_line_error, dtf
from lab import Lab, LabError, second_identity

pytestmark = pytest.mark.lab

HOSTS = 8
FAKE = {"DTF_SERVER": "fake"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, Path, list[int]]]:
    """A lab of 8 hosts beside the session's (its own name and subnet: DTF_LAB2_NAME and
    DTF_LAB2_SUBNET, else the first free pair), a cluster of fake servers on all of them (one
    task each), and the DTF_HOME that knows it. Network namespaces are needed (to count bytes)."""
    ci = os.environ.get("CI") == "true"
    if os.geteuid() != 0 or not os.access("/usr/sbin/sshd", os.X_OK):
        if ci:
            pytest.fail("SSH lab unavailable: not root, or no /usr/sbin/sshd (CI=true: the lab is required)")
        pytest.skip("SSH lab unavailable: not root, or no /usr/sbin/sshd")
    root = tmp_path_factory.mktemp("treelab")
    ident = second_identity()
    try:
        big = Lab(HOSTS, root=root / "lab", mode="netns", **(ident or {}), pick=ident is None).__enter__()
    except LabError as e:
        if ci:
            pytest.fail(f"a lab of {HOSTS} hosts in network namespaces failed: {e}")
        pytest.skip(f"a lab of {HOSTS} hosts in network namespaces failed: {e}")
    home = root / "home"
    try:
        ports = big.ports(HOSTS)
        inv = big.inventory(root / "tree.yaml", [
            {"host": h.name, ("ps" if i == 0 else "workers"): [ports[i]]} for i, h in enumerate(big.hosts)])
        r = dtf("up", str(inv), home=home, env=FAKE, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        yield big, home, ports
    finally:
        dtf("down", home=home, env=FAKE, timeout=300)
        big.close()


def make_data(root: Path, large: int, small: int) -> None:
    """`large` random files of 1 MB and `small` of 10 KB."""
    for i in range(large):
        (root / f"big{i}.bin").write_bytes(os.urandom(1_000_000))
    (root / "small").mkdir()
    for i in range(small):
        (root / "small" / f"s{i}.bin").write_bytes(os.urandom(10_000))


def assert_holds(big: Lab, host: str, data: Path, digest: str) -> None:
    """The host's tree DIGEST has every file of `data`, with the same sha256 (and nothing else)."""
    tree = Path(big.host(host).workdir) / ".cache" / "sync" / digest
    local = {p.relative_to(data): hashlib.sha256(p.read_bytes()).hexdigest() for p in data.rglob("*") if p.is_file()}
    there = {p.relative_to(tree): hashlib.sha256(p.read_bytes()).hexdigest() for p in tree.rglob("*") if p.is_file()}
    assert there == local, host


def test_sync_to_8_hosts_sends_the_data_once_from_the_laptop(cluster: tuple[Lab, Path, list[int]]) -> None:
    big, home, _ = cluster
    data = big.laptop_dir("tree-once")
    make_data(data, 6, 100)
    pack = sync.pack(data, "once")
    before = big.laptop_bytes()
    r = dtf("sync", str(data), "--as", "once", home=home, timeout=300)
    out = big.laptop_bytes() - before
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sent to h0 (" in r.stdout and "h1, h2, h3 and 4 more copied it from other hosts" in r.stdout, r.stdout
    # Once the pack, plus SSH's framing and the 8 hosts' checks; every host receiving it from the
    # laptop would be 8 times the pack.
    assert pack.bytes <= out < 1.25 * pack.bytes, (out, pack.bytes)
    for h in big.hosts:
        assert_holds(big, h.name, data, pack.digest)


@contextlib.contextmanager
def laptop_rules(big: Lab, rules: str) -> Iterator[str]:
    """nftables rules on this machine's output (the lab's subnet only), removed on exit; yields
    the table's name."""
    table = f"{big.name}_tree"
    big.nft(None, f"table inet {table} {{\n chain out {{\n  type filter hook output priority 0;\n{rules}\n }}\n}}\n")
    try:
        yield table
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, timeout=10)


def wait_for(what: str, cond: Callable[[], bool], deadline: float = 120.0) -> None:
    """Until cond() holds (a hang guard: the deadline is never reached when things work)."""
    end = time.monotonic() + deadline
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_host_failing_mid_pass_is_named_and_the_others_get_the_data(cluster: tuple[Lab, Path, list[int]]) -> None:
    """h1 (in the tree: h0's child, the parent of h3 and h4) dies while the data passes through it,
    and the laptop can no longer reach it: dtf names h1 in one line; the laptop sends the pack to
    h3 and h4 itself, and every other host holds the whole tree."""
    big, home, _ = cluster
    h0, h1 = big.host("h0"), big.host("h1")
    data = big.laptop_dir("tree-cut")
    make_data(data, 12, 50)
    pack = sync.pack(data, "cut")
    cache1 = Path(h1.workdir) / ".cache" / "sync"

    def h1_receiving() -> bool:  # a file of the pack is being written in h1's temporary tree
        return cache1.is_dir() and any(p.is_file() for d in cache1.glob(".tmp-*") for p in d.rglob("*"))

    # The laptop's stream to h0 stops after 4 MB (dropped, not refused: TCP waits and retries):
    # the pack is then stuck part way down the tree, whatever the machine's speed.
    gate = f"  ip daddr {h0.address} tcp dport 22 quota over 4 mbytes drop"
    with laptop_rules(big, gate) as table:
        proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "sync", str(data), "--as", "cut"],
                                env={**os.environ, "DTF_HOME": str(home), "COLUMNS": "200"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for("h1 to receive part of the pack", h1_receiving)
            # h1 dies (its receiving launcher, killed), and the laptop can no longer reach it.
            refuse_h1 = ["nft", "add", "rule", "inet", table, "out", "ip", "daddr", h1.address, "tcp", "dport",
                         "22", "reject", "with", "tcp", "reset"]
            subprocess.run(refuse_h1, check=True, timeout=10)
            victims = [pid for pid, cmd in big.processes(h1) if " sync " in cmd and "--receive" in cmd]
            assert victims
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            wait_for("h1's launcher to die", lambda: not any(pid in dict(big.processes(h1)) for pid in victims))
            # Open the gate: the rest of the pack flows.
            subprocess.run(["nft", "flush", "chain", "inet", table, "out"], check=True, timeout=10)
            subprocess.run(refuse_h1, check=True, timeout=10)
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == ExitCode.HOSTS, (stdout, stderr)
    assert "Traceback" not in stderr + stdout
    assert "dtf sync failed on 1 host(s):" in stderr and "\n  h1: " in stderr, stderr
    h1_line = next(line for line in stderr.splitlines() if line.startswith("  h1: "))
    assert len(h1_line) < 300, h1_line
    for h in big.hosts:
        if h.name != "h1":
            assert_holds(big, h.name, data, pack.digest)
    assert not (cache1 / pack.digest).exists()


def test_hosts_that_cannot_reach_the_tree_get_the_data_from_the_laptop(cluster: tuple[Lab, Path, list[int]]) -> None:
    """h0, the tree's root, takes connections only on its SSH and TF ports (a firewall between the
    hosts): its children cannot copy from it, nor theirs from them. After the relay wait (1 s
    here, DTF_SYNC_RELAY_WAIT) the laptop sends to each of them: the sync succeeds, the slow way."""
    big, home, ports = cluster
    h0 = big.host("h0")
    data = big.laptop_dir("tree-walled")
    make_data(data, 2, 20)
    pack = sync.pack(data, "walled")
    table = f"{big.name}_walled"
    big.nft(h0, f"table inet {table} {{\n chain in {{\n  type filter hook input priority 0;\n"
                f"  tcp dport != {{ 22, {ports[0]} }} ct state new reject with tcp reset\n }}\n}}\n")
    try:
        before = big.laptop_bytes()
        r = dtf("sync", str(data), "--as", "walled", home=home, env={"DTF_SYNC_RELAY_WAIT": "1"}, timeout=300)
        out = big.laptop_bytes() - before
    finally:
        big.run(h0, ["nft", "delete", "table", "inet", table], timeout=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"sent to {h.name} (" in r.stdout for h in big.hosts), r.stdout
    assert out >= HOSTS * pack.bytes, (out, pack.bytes)
    for h in big.hosts:
        assert_holds(big, h.name, data, pack.digest)


def test_a_bad_relay_wait_is_one_line(cluster: tuple[Lab, Path, list[int]]) -> None:
    big, home, _ = cluster
    data = big.laptop_dir("tree-bad-wait")
    make_data(data, 1, 0)
    r = dtf("sync", str(data), home=home, env={"DTF_SYNC_RELAY_WAIT": "soon"}, timeout=120)
    assert_one_line_error(r, ExitCode.USAGE, "DTF_SYNC_RELAY_WAIT: expected seconds", "'soon'")
