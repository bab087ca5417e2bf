"""From host to host (dtf.files.relay, dtf_server.receive's relay): the tree's shape, and a pack
passed down a small tree on loopback, in threads: every stage gets the same tree, a stranger
without the token is refused, and a parent cut mid-stream fails its children (they never keep a
partial tree); which hosts the client puts in the tree. The real thing, on SSH hosts, is
tests/fake/test_sync_tree.py."""

from __future__ import annotations

import io
import os
import socket
import threading
from pathlib import Path

from dtf.cluster.inventory import loads
from dtf.cluster.plan import make_plan
from dtf.files import relay, sync
from dtf.hostops.syncing import plan_tree
from dtf_server import receive


def test_the_tree_bounds_each_hosts_children_and_stays_shallow() -> None:
    hosts = [f"h{i}" for i in range(30)]
    parents = relay.tree(hosts, 2)
    assert parents["h0"] is None and parents["h1"] == parents["h2"] == "h0" and parents["h3"] == "h1"
    assert max(len(relay.children(parents, h)) for h in hosts) == 2

    def depth(h: str) -> int:
        p = parents[h]
        return 0 if p is None else 1 + depth(p)

    assert max(depth(h) for h in hosts) == 4  # 30 hosts: 1 + 2 + 4 + 8 + 15
    assert relay.tree(["a"], 2) == {"a": None} and relay.tree([], 3) == {}


def test_wheel_relay_joins_grow_a_tree_of_bounded_fanout() -> None:
    r = relay.Relay(fanout=3)
    nodes = [r.join("linux-py311", f"h{i}") for i in range(13)]
    assert nodes[0].parent is None and r.join("linux-py311", "h0") is nodes[0]
    served = {n.host: sum(1 for m in nodes if m.parent is n) for n in nodes}
    assert max(served.values()) == 3 and nodes[12].parent is nodes[3]
    assert r.join("other-target", "h5").parent is None  # a tree per target


def _pack(tmp_path: Path) -> tuple[bytes, str]:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(os.urandom(300_000))
    (data / "sub" / "b.txt").write_text("hello\n" * 1000)
    out = io.BytesIO()
    digest, _, _ = sync.write_pack(sync.list_files(data).files, out)
    return out.getvalue(), digest


class _Cut(io.RawIOBase):
    """A stream that breaks after `limit` bytes (a laptop that went away mid-send)."""

    def __init__(self, data: bytes, limit: int) -> None:
        self.data, self.limit, self.pos = data, limit, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self.pos >= self.limit:
            raise ConnectionResetError(104, "Connection reset by peer")
        n = self.limit - self.pos if size < 0 else min(size, self.limit - self.pos)
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk


def _stage(cache: Path, digest: str, source: str | None, stream: object, port: int, children: int,
           token: str, results: dict[str, object], name: str) -> None:
    try:
        r = receive.Relay(port, children, token) if children else None
        src = receive.connect(source, token, wait=10) if source else stream
        complete = False
        try:
            if r is not None:
                r.accept(wait=10)
            results[name] = receive.receive(str(cache), digest, src, r.write if r else None)  # type: ignore[arg-type]
            complete = True
        finally:
            if r is not None:
                r.close(complete)
    except receive.ReceiveError as e:
        results[name] = e


def _run_tree(tmp_path: Path, stream: object, digest: str, token: str = "t0k3n"
              ) -> tuple[dict[str, object], dict[str, Path]]:
    """root -> (c1, c2), c1 -> g1: each a thread; the root reads `stream`."""
    ports = {n: receive.free_port() for n in ("root", "c1")}
    caches = {n: tmp_path / n for n in ("root", "c1", "c2", "g1")}
    results: dict[str, object] = {}
    stages = [("root", None, 2), ("c1", f"127.0.0.1:{ports['root']}", 1),
              ("c2", f"127.0.0.1:{ports['root']}", 0), ("g1", f"127.0.0.1:{ports['c1']}", 0)]
    threads = [threading.Thread(target=_stage, args=(caches[n], digest, src, stream, ports.get(n, 0), kids,
                                                     token, results, n)) for n, src, kids in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    return results, caches


def test_a_pack_flows_down_the_tree_and_every_stage_checks_it(tmp_path: Path) -> None:
    data, digest = _pack(tmp_path)
    results, caches = _run_tree(tmp_path, io.BytesIO(data), digest)
    for name, cache in caches.items():
        assert results[name] == len(data), (name, results[name])
        tree = cache / digest
        assert (tree / "a.bin").read_bytes() == (tmp_path / "data" / "a.bin").read_bytes()
        assert (tree / "sub" / "b.txt").read_text() == "hello\n" * 1000


def test_a_relay_passes_the_stream_only_to_children_with_the_token() -> None:
    port = receive.free_port()
    r = receive.Relay(port, 1, "t0k3n")
    stranger = socket.create_connection(("127.0.0.1", port), timeout=10)
    stranger.sendall(b"guess\n")
    child = socket.create_connection(("127.0.0.1", port), timeout=10)
    child.sendall(b"t0k3n\n")
    r.accept(wait=10)
    assert len(r.peers) == 1
    r.write(b"the pack")
    closing = threading.Thread(target=r.close, args=(True,))
    closing.start()
    assert stranger.recv(100) == b""  # closed, nothing sent
    got = b""
    while chunk := child.recv(100):
        got += chunk
    child.close()
    closing.join(timeout=10)
    assert got == b"the pack" and r.passed == 1
    stranger.close()


def test_a_parent_cut_mid_stream_fails_its_whole_subtree_and_keeps_nothing(tmp_path: Path) -> None:
    data, digest = _pack(tmp_path)
    results, caches = _run_tree(tmp_path, _Cut(data, len(data) // 2), digest)
    for name, cache in caches.items():
        assert isinstance(results[name], receive.ReceiveError), (name, results[name])
        assert not (cache / digest).exists()
        assert not [p for p in cache.iterdir() if p.name.startswith(receive.TMP_PREFIX)]


def test_the_sync_tree_takes_ssh_hosts_with_a_free_port_at_their_planned_address() -> None:
    inv = loads("cluster: c\nhosts:\n"
                "  - {host: a, address: 10.0.0.1, ps: 1}\n  - {host: b, address: 10.0.0.2, workers: 1}\n"
                "  - {host: c, address: 10.0.0.3, workers: 1}\n  - {host: d, address: 10.0.0.4, workers: 1}\n"
                "  - {host: localhost, connection: local, workers: 1}\n", "inv.yaml")
    hosts = make_plan(inv).hosts
    tree = plan_tree(hosts, {"a": 4000, "b": 4001, "c": 0, "d": 4003, "localhost": 4004})
    # c reported no free port, localhost is this machine: the laptop sends to them directly.
    assert tree.parents == {"a": None, "b": "a", "d": "a"}
    assert tree.relays == {"a": "10.0.0.1:4000", "b": "10.0.0.2:4001", "d": "10.0.0.4:4003"}
    assert len(tree.token) == 32 and plan_tree(hosts, {"a": 4000}).parents == {}  # one host: no tree
