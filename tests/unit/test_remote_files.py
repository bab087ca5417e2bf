"""Bringing a host's tree back as a tar on a command's stdout (dtf.hosts.trees: over an OpenSSH
master's session, or a Slurm node's job step): a stream cut short on its way back is seen (by
tarfile, or by GNU tar's --totals where it ends on a member's boundary) and fetched again; after
FETCH_TRIES, one line. The same tar made by a local shell, and the local twin's copy."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any, cast

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.collective import remote_files
from dtf.hosts import trees
from dtf.hosts.base import HostError
from dtf.hosts.local import LocalRunner


def tar_of(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


FILES = {"./a.bin": b"a" * 3000, "./b/c.txt": b"c" * 700}
WHOLE = tar_of(FILES)
TOTALS = f"Total bytes written: {len(WHOLE)} (10KiB, 1.0MiB/s)"


def test_a_whole_stream_is_unpacked(tmp_path: Path) -> None:
    assert trees.untar(io.BytesIO(WHOLE), tmp_path, "out", 0, TOTALS) == 2
    assert (tmp_path / "b" / "c.txt").read_bytes() == FILES["./b/c.txt"]
    assert trees.untar(io.BytesIO(WHOLE), tmp_path / "plain", "out", 0, "") == 2  # (not GNU tar)


def test_no_tree_is_nothing(tmp_path: Path) -> None:
    assert trees.untar(io.BytesIO(b""), tmp_path, "out", 3, "") == 0


@pytest.mark.parametrize("cut, err", [
    (1000, ""),  # inside a member's data: tarfile sees it
    (512 + 3072, TOTALS),  # on a member's boundary: a tar that looks whole, but fewer bytes than tar wrote
])
def test_a_stream_cut_short_is_seen(tmp_path: Path, cut: int, err: str) -> None:
    with pytest.raises(trees.Short):
        trees.untar(io.BytesIO(WHOLE[:cut]), tmp_path, "out", 0, err)


def test_a_failure_names_tars_error_not_its_totals(tmp_path: Path) -> None:
    with pytest.raises(HostError, match=r"copying out back failed: tar: ./x: Cannot open: Permission denied$"):
        trees.untar(io.BytesIO(b""), tmp_path, "out", 2,
                            f"tar: ./x: Cannot open: Permission denied\n{TOTALS}")


def test_a_short_stream_is_fetched_again_then_said_in_one_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [(WHOLE[:1000], 0, ""), (WHOLE, 0, TOTALS)]
    monkeypatch.setattr(trees, "tar_of", lambda t, remote: (io.BytesIO(answers.pop(0)[0]), 0, TOTALS))
    assert trees.fetch_by_tar(cast(Any, None), "out", tmp_path) == 2 and answers == []

    tries: list[int] = []

    def short(t: object, remote: str) -> tuple[io.BytesIO, int, str]:
        tries.append(1)
        return io.BytesIO(WHOLE[:1000]), 0, TOTALS

    monkeypatch.setattr(trees, "tar_of", short)
    with pytest.raises(HostError) as e:
        trees.fetch_by_tar(cast(Any, None), "~/dtf/out", tmp_path)
    assert len(tries) == trees.FETCH_TRIES
    assert str(e.value) == (f"copying ~/dtf/out back failed: its tar came back incomplete {trees.FETCH_TRIES} "
                            f"times (1000 of {len(WHOLE)} bytes)")


SPEC = HostSpec(host="here", line=1, connection="local", user=None, port=None, identity_file=None,
                python="python3", workdir="/tmp", address=None, ps_ports=(), worker_ports=())


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_tree_comes_back_as_a_tar_from_a_real_shell(tmp_path: Path) -> None:
    """TAR_OUT run by a shell (here this machine's, as a master's session or a job step runs it)."""
    source = tmp_path / "out"
    (source / "b").mkdir(parents=True)
    (source / "a.bin").write_bytes(b"a" * 3000)
    (source / "b" / "c.txt").write_bytes(b"c" * 700)
    assert trees.fetch_by_tar(LocalRunner(SPEC), str(source), tmp_path / "back") == 2
    assert tree(tmp_path / "back") == tree(source)
    assert trees.fetch_by_tar(LocalRunner(SPEC), str(tmp_path / "missing"), tmp_path / "none") == 0


def test_fetch_tree_over_the_local_twin_copies(tmp_path: Path) -> None:
    source = tmp_path / "out"
    (source / "__pycache__").mkdir(parents=True)
    (source / "__pycache__" / "x.pyc").write_bytes(b"x")
    (source / "model.txt").write_text("m")
    assert remote_files.fetch_tree(LocalRunner(SPEC), str(source), tmp_path / "back") == 1
    assert (tmp_path / "back" / "model.txt").read_text() == "m"
    assert remote_files.fetch_tree(LocalRunner(SPEC), str(tmp_path / "missing"), tmp_path / "none") == 0


def test_send_tree_unpacks_with_the_hosts_python_once_or_merged(tmp_path: Path) -> None:
    """The unpack program (package data: dtf/cluster/scripts/unpack.py) run by a python as a host
    runs it: `once` puts the tree in place only where it is missing; otherwise merged into it; the
    tar is removed either way."""
    import sys
    from types import SimpleNamespace

    host = cast(Any, SimpleNamespace(python=sys.executable))
    dest = tmp_path / "program"
    remote_files.send_tree(LocalRunner(SPEC), host, tar_of(FILES), str(dest), once=True)
    assert tree(dest) == {"a.bin": FILES["./a.bin"], "b/c.txt": FILES["./b/c.txt"]}
    remote_files.send_tree(LocalRunner(SPEC), host, tar_of({"./d.txt": b"d"}), str(dest), once=True)
    assert "d.txt" not in tree(dest)  # there already: left as it was
    remote_files.send_tree(LocalRunner(SPEC), host, tar_of({"./d.txt": b"d"}), str(dest))
    assert tree(dest)["d.txt"] == b"d" and "a.bin" in tree(dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program"]  # no tar, no temporary directory left
