"""Bringing a Slurm node's tree back as a tar on a job step's stdout (dtf.collective.remote_files):
a stream cut short on its way back is seen (by tarfile, or by GNU tar's --totals where it ends on
a member's boundary) and fetched again; after FETCH_TRIES, one line."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any, cast

import pytest

from dtf.collective import remote_files
from dtf.hosts.transport import HostError


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
    assert remote_files._untar(io.BytesIO(WHOLE), tmp_path, "out", 0, TOTALS) == 2
    assert (tmp_path / "b" / "c.txt").read_bytes() == FILES["./b/c.txt"]
    assert remote_files._untar(io.BytesIO(WHOLE), tmp_path / "plain", "out", 0, "") == 2  # (not GNU tar)


def test_no_tree_is_nothing(tmp_path: Path) -> None:
    assert remote_files._untar(io.BytesIO(b""), tmp_path, "out", 3, "") == 0


@pytest.mark.parametrize("cut, err", [
    (1000, ""),  # inside a member's data: tarfile sees it
    (512 + 3072, TOTALS),  # on a member's boundary: a tar that looks whole, but fewer bytes than tar wrote
])
def test_a_stream_cut_short_is_seen(tmp_path: Path, cut: int, err: str) -> None:
    with pytest.raises(remote_files._Short):
        remote_files._untar(io.BytesIO(WHOLE[:cut]), tmp_path, "out", 0, err)


def test_a_failure_names_tars_error_not_its_totals(tmp_path: Path) -> None:
    with pytest.raises(HostError, match=r"copying out back failed: tar: ./x: Cannot open: Permission denied$"):
        remote_files._untar(io.BytesIO(b""), tmp_path, "out", 2,
                            f"tar: ./x: Cannot open: Permission denied\n{TOTALS}")


def test_a_short_stream_is_fetched_again_then_said_in_one_line(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [(WHOLE[:1000], 0, ""), (WHOLE, 0, TOTALS)]
    monkeypatch.setattr(remote_files, "_tar_of", lambda t, remote: (io.BytesIO(answers.pop(0)[0]), 0, TOTALS))
    assert remote_files._fetch_by_tar(cast(Any, None), "out", tmp_path) == 2 and answers == []

    tries: list[int] = []

    def short(t: object, remote: str) -> tuple[io.BytesIO, int, str]:
        tries.append(1)
        return io.BytesIO(WHOLE[:1000]), 0, TOTALS

    monkeypatch.setattr(remote_files, "_tar_of", short)
    with pytest.raises(HostError) as e:
        remote_files._fetch_by_tar(cast(Any, None), "~/dtf/out", tmp_path)
    assert len(tries) == remote_files.FETCH_TRIES
    assert str(e.value) == (f"copying ~/dtf/out back failed: its tar came back incomplete {remote_files.FETCH_TRIES} "
                            f"times (1000 of {len(WHOLE)} bytes)")
