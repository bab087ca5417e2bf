"""dtf sync's pure parts: which files (.gitignore, nested), the deterministic pack and its hash,
the host's receive (hash checked, members checked, atomic), the inventory's `sync:`, and how the
program finds the data (DTF_SYNCED, dtf.synced)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

import dtf
from dtf.cluster.inventory import loads
from dtf.cluster.plan import Plan, make_plan
from dtf.cluster.state import Record
from dtf.errors import InventoryError
from dtf.files import sync
from dtf.program.train import program_env
from dtf_server import receive


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def names(root: Path) -> list[str]:
    return [name for name, _ in sync.list_files(root).files]


# -- which files ------------------------------------------------------------------------------
def test_gitignore_files_apply_nested_as_git_does(tmp_path: Path) -> None:
    root = tree(tmp_path / "d", {
        ".gitignore": "*.log\n!keep.log\nbuild/\n/top-only\n",
        "a.txt": "", "x.log": "", "keep.log": "", "build/out": "", "top-only": "",
        "sub/top-only": "",  # `/top-only` is anchored to its .gitignore's directory
        "sub/.gitignore": "secret\n!x.log\n",  # a deeper file wins: x.log is back below sub/
        "sub/secret": "", "sub/deep/secret": "", "sub/x.log": "", "sub/deep/y.log": "",
        "sub/build/z": "",  # build/ (a directory pattern) matches at any depth
        ".git/HEAD": "",  # never sent
    })
    assert names(root) == [".gitignore", "a.txt", "keep.log", "sub/.gitignore", "sub/top-only", "sub/x.log"]


def test_a_single_file_is_itself_and_an_empty_tree_is_an_error(tmp_path: Path) -> None:
    tree(tmp_path, {"d/.gitignore": "*\n", "one.csv": "1\n"})
    assert names(tmp_path / "one.csv") == ["one.csv"]
    with pytest.raises(sync.SyncError, match="no file to send"):
        sync.list_files(tmp_path / "d")
    with pytest.raises(sync.SyncError, match="no such file"):
        sync.pack(tmp_path / "missing", "x")


def test_links_to_files_are_sent_as_files_and_links_to_directories_are_skipped(tmp_path: Path) -> None:
    root = tree(tmp_path / "d", {"a.txt": "a", "sub/b": "b"})
    os.symlink("a.txt", root / "link")
    os.symlink("sub", root / "dirlink")
    listed = sync.list_files(root)
    assert [n for n, _ in listed.files] == ["a.txt", "link", "sub/b"]
    assert listed.skipped == ("dirlink (a link to a directory: not followed)",)


def read(p: sync.Pack, size: int = -1) -> bytes:
    with p.open() as stream:
        if size < 0:
            return stream.read()
        chunks = []
        while chunk := stream.read(size):
            chunks.append(chunk)
        return b"".join(chunks)


# -- the pack ---------------------------------------------------------------------------------
def test_the_pack_depends_on_names_contents_and_the_exec_bit_only(tmp_path: Path) -> None:
    files = {"b/2.csv": "2", "a.txt": "hello", "c/d/e": "x" * 10000}
    one = tree(tmp_path / "one", files)
    two = tree(tmp_path / "two", dict(reversed(files.items())))  # other order, times, directory
    os.utime(two / "a.txt", (1, 1))
    os.chmod(two / "b" / "2.csv", 0o600)  # only the exec bit counts
    p1, p2 = sync.pack(one, "x"), sync.pack(two, "y")
    assert p1.digest == p2.digest and read(p1) == read(p2)
    assert len(read(p1)) == p1.bytes
    assert (p1.synced.files, p1.synced.size, p1.synced.subpath) == (3, 10006, "")
    os.chmod(two / "a.txt", 0o755)
    assert sync.pack(two, "y").digest != p1.digest
    (one / "a.txt").write_text("hellO")
    assert sync.pack(one, "x").digest != p1.digest
    with tarfile.open(fileobj=io.BytesIO(read(p1))) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["a.txt", "b/2.csv", "c/d/e"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in members} == {(0, 0, 0, "", 0o644)}


def test_the_stream_is_the_pack_whatever_the_reads_and_stops_when_closed(tmp_path: Path) -> None:
    root = tree(tmp_path / "d", {f"f{i}": "x" * (i * 7919) for i in range(40)})
    p = sync.pack(root, "d")
    data = read(p)
    assert read(p, 1000) == read(p, 1 << 20) == data and len(data) == p.bytes
    stream = p.open()
    assert stream.read(10) == data[:10]
    stream.close()  # the writer thread stops although nobody reads the rest
    assert not stream.thread.is_alive()
    (root / "f39").write_text("")  # changed since it was hashed: other bytes (the host refuses them)
    assert read(p) != data
    (root / "f38").unlink()
    with pytest.raises(sync.SyncError, match=r"cannot read .*f38"):
        read(p)


def test_a_large_pack_warns_naming_its_largest_files(tmp_path: Path) -> None:
    root = tree(tmp_path / "d", {"small": "x", "big.bin": "y" * 5000, "mid.bin": "z" * 3000})
    p = sync.pack(root, "d")
    assert sync.large_warning(p) is None
    warning = sync.large_warning(p, threshold=1000)
    assert warning is not None and "big.bin (0.0 MB), mid.bin (0.0 MB), small" in warning


# -- the host's side --------------------------------------------------------------------------
def test_receive_checks_the_hash_and_is_atomic(tmp_path: Path) -> None:
    root = tree(tmp_path / "d", {"a/b.txt": "b", "run.sh": "#!/bin/sh\n"})
    os.chmod(root / "run.sh", 0o755)
    p = sync.pack(root, "d")
    cache = tmp_path / "cache"
    data = read(p)
    with pytest.raises(receive.ReceiveError, match="does not hash to"):
        receive.receive(str(cache), p.digest, io.BytesIO(data[:-1024] + b"\1" * 1024))
    with pytest.raises(receive.ReceiveError):
        receive.receive(str(cache), p.digest, io.BytesIO(data[: len(data) // 2]))
    assert list(cache.iterdir()) == []  # nothing half-written is left, nothing is named DIGEST
    assert receive.receive(str(cache), p.digest, io.BytesIO(data)) == len(data)
    out = cache / p.digest
    assert (out / "a" / "b.txt").read_text() == "b" and os.access(out / "run.sh", os.X_OK)
    assert receive.present(str(cache), p.digest)
    # A second receive of the same tree (a racing sender) keeps the first.
    assert receive.receive(str(cache), p.digest, io.BytesIO(data)) == len(data)
    assert sorted(x.name for x in cache.iterdir()) == [p.digest]


@pytest.mark.parametrize(("name", "kind"), [("../evil", tarfile.REGTYPE), ("/abs", tarfile.REGTYPE),
                                            ("link", tarfile.SYMTYPE), ("dev", tarfile.CHRTYPE)])
def test_receive_refuses_members_outside_the_tree_and_non_files(tmp_path: Path, name: str, kind: bytes) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "/etc/passwd"
        tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    import hashlib

    data = buffer.getvalue()
    with pytest.raises(receive.ReceiveError, match="refusing"):
        receive.receive(str(tmp_path / "cache"), hashlib.sha256(data).hexdigest(), io.BytesIO(data))
    assert not (tmp_path / "evil").exists() and list((tmp_path / "cache").iterdir()) == []


# -- the inventory's sync: --------------------------------------------------------------------
BASE = "cluster: c\nhosts:\n  - {host: h, ps: 1, workers: 1}\n"


def test_inventory_sync_entries() -> None:
    inv = loads(BASE + "sync:\n  - data/\n  - {path: ~/sets/mnist, as: digits}\n  - path: x.csv\n", "inv.yaml")
    assert [(s.path, s.name, s.line, s.column) for s in inv.sync] == [
        ("data/", "data", 5, 5), ("~/sets/mnist", "digits", 6, 5), ("x.csv", "x.csv", 7, 5)]


def test_inventory_sync_mistakes_point_at_the_entry() -> None:
    text = BASE + ("sync:\n  - data\n  - {path: other/data}\n  - {as: x}\n  - {path: y, as: 'a b'}\n"
                   "  - {path: z, pth: 1}\n  - '.'\n  - 3\n")
    with pytest.raises(InventoryError) as info:
        loads(text, "inv.yaml")
    assert info.value.lines() == [
        "inv.yaml:6:5: sync[1]: the name 'data' is already used by sync[0] (line 5): give one of them "
        "another with `as:`",
        "inv.yaml:7:5: sync[2]: missing required key 'path'",
        "inv.yaml:8:15: sync[3].as: expected a name of at most 63 letters, digits, '_', '.' or '-', "
        "starting with a letter or digit, got 'a b'",
        "inv.yaml:9:15: sync[4].pth: unknown key (did you mean 'path'?)",
        "inv.yaml:10:5: sync[5]: expected a name of at most 63 letters, digits, '_', '.' or '-', starting "
        "with a letter or digit, got '.' (name it with `as:`)",
        "inv.yaml:11:5: sync[6]: expected a path, got 3",
    ]
    with pytest.raises(InventoryError, match="sync: expected a list of paths"):
        loads(BASE + "sync: data\n", "inv.yaml")


def test_the_plan_resolves_sync_paths_from_the_inventory_directory(tmp_path: Path) -> None:
    inv = loads(BASE + f"sync:\n  - data\n  - {{path: {tmp_path}/abs, as: b}}\n", str(tmp_path / "inv" / "c.yaml"))
    plan = make_plan(inv)
    assert [(s.name, s.path, s.line) for s in plan.sync] == [("data", str(tmp_path / "inv" / "data"), 5),
                                                             ("b", str(tmp_path / "abs"), 6)]
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


# -- how the program finds it -----------------------------------------------------------------
def synced_tree(name: str = "data", subpath: str = "") -> sync.Synced:
    return sync.Synced(name=name, digest="ab" * 32, subpath=subpath, source="/l/data", size=3, files=1)


def test_the_record_and_the_program_env_carry_the_workers_paths() -> None:
    plan = make_plan(loads(BASE, "inv.yaml"))
    record = Record(plan=plan, inventory="/inv.yaml", created=1.0, chief_host="10.0.0.1",
                    synced={"data": synced_tree(), "one": synced_tree("one", "f.csv")})
    assert Record.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert record.synced["one"].task_path == f"../../.cache/sync/{'ab' * 32}/f.csv"
    assert record.synced["one"].host_path(plan.hosts[0]) == f"~/.dtf/.cache/sync/{'ab' * 32}/f.csv"
    env = program_env(plan, "10.0.0.1", None, synced={n: s.task_path for n, s in record.synced.items()})
    assert json.loads(env["DTF_SYNCED"]) == {"data": f"../../.cache/sync/{'ab' * 32}",
                                             "one": f"../../.cache/sync/{'ab' * 32}/f.csv"}


def test_dtf_synced_under_dtf_train_and_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("DTF_CLUSTER", "c")
    monkeypatch.setenv("DTF_SYNCED", json.dumps({"data": "../../.cache/sync/ab"}))
    assert dtf.synced("data", "train.csv") == "../../.cache/sync/ab/train.csv"
    with pytest.raises(LookupError, match=r"nothing named 'other' was synced to cluster 'c' \(synced: data\)"):
        dtf.synced("other")
    for var in ("TF_CONFIG", "DTF_CLUSTER", "DTF_SYNCED"):
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert dtf.synced("data", "x.csv") == "data/x.csv"
    assert dtf.synced("d2", local=tmp_path / "data") == str(tmp_path / "data")
    with pytest.raises(LookupError, match="not under `dtf train`, and 'nope' does not exist here"):
        dtf.synced("nope")


def test_up_dry_run_shows_the_sync_and_a_missing_path_is_an_inventory_error(tmp_path: Path) -> None:
    from helpers import assert_one_line_error
    from helpers import dtf as run_dtf

    (tmp_path / "data").mkdir()
    inv = tmp_path / "inv.yaml"
    inv.write_text("cluster: c\nhosts:\n  - {host: localhost, connection: local, ps: 1, workers: 1}\n"
                   "sync:\n  - data\n")
    r = run_dtf("up", "--dry-run", str(inv), home=tmp_path / "home", timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"sync     {tmp_path / 'data'} to every host as 'data'" in r.stdout
    inv.write_text(inv.read_text() + "  - {path: gone, as: g}\n")
    r = run_dtf("up", "--dry-run", str(inv), home=tmp_path / "home", timeout=60)
    assert_one_line_error(r, 3, f"{inv}:6:5: sync[1]: {tmp_path / 'gone'}: no such file or directory")
