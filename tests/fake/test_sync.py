"""`dtf sync` and the inventory's `sync:` against fake servers, on local processes and on the SSH
lab: the data reaches every host's WORKDIR/.cache/sync/HASH, a repeat sends nothing, a change
sends the new tree, `dtf down` keeps the cache. On the lab the data lives where no host sees it
(lab.laptop_dir), so the files there travelled. The TensorFlow side (a dataset_fn reading it on the
workers) is tests/e2e/test_synced_data.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from helpers import assert_one_line_error
from sites import LabSite, Site


def data_dir(site: Site, name: str) -> Path:
    """A directory on the laptop; on the lab, one no host can see."""
    if isinstance(site, LabSite):
        return site.lab.laptop_dir(name)
    path = site.tmp / name
    path.mkdir()
    return path


def on_host(site: Site, host: str, path: Path) -> bool:
    if isinstance(site, LabSite):
        return site.lab.exists(site.host(host), path)
    return path.exists()


def with_sync(inventory: Path, entries: list) -> Path:
    doc = yaml.safe_load(inventory.read_text())
    doc["sync"] = entries
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inventory


def synced(site: Site) -> dict:
    return json.loads(site.record().read_text())["synced"]


def test_sync_at_up_then_dtf_sync_skips_what_hosts_have_and_down_keeps_it(site: Site):
    data = data_dir(site, "data")
    (data / "train.csv").write_text("x,y\n1,2\n")
    (data / "sub").mkdir()
    (data / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (data / "scratch.tmp").write_text("not sent")
    (data / ".gitignore").write_text("*.tmp\n")
    inv = with_sync(site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}}),
                    [{"path": str(data), "as": "train"}])
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    digest = synced(site)["train"]["digest"]
    assert re.search(rf"synced train \(3 file\(s\), .* {digest[:12]}\): sent to {site.host('a')}", r.stdout), r.stdout
    for host in ("a", "b"):
        tree = site.workdir(host) / ".cache" / "sync" / digest
        assert on_host(site, host, tree / "train.csv") and on_host(site, host, tree / "sub" / "b.bin")
        assert not on_host(site, host, tree / "scratch.tmp")  # .gitignore'd

    # `dtf up` again (the cluster is up): nothing to restart, and every host has the data.
    r = site.dtf("up", str(inv))
    assert r.returncode == 0 and "is already up" in r.stdout, r.stderr
    assert "had it already (skipped)" in r.stdout and "sent to" not in r.stdout, r.stdout
    # Again: every host has it, nothing is sent.
    r = site.dtf("sync", str(data), "--as", "train")
    assert r.returncode == 0, r.stderr
    assert f"{site.host('a')}, {site.host('b')} had it already (skipped)" in r.stdout, r.stdout
    assert "sent to" not in r.stdout

    # A change is a new tree; a single file too; the record maps each name to its tree.
    (data / "train.csv").write_text("x,y\n1,2\n3,4\n")
    one = data_dir(site, "single") / "labels.txt"
    one.write_text("a\nb\n")
    assert site.dtf("sync", str(data), "--as", "train").returncode == 0
    r = site.dtf("sync", str(one), env={"DTF_SSH": "none"})  # no ssh binary: paramiko carries it
    assert r.returncode == 0, r.stderr
    record = synced(site)
    assert record["train"]["digest"] != digest and record["labels.txt"]["subpath"] == "labels.txt"
    for host in ("a", "b"):
        cache = site.workdir(host) / ".cache" / "sync"
        assert on_host(site, host, cache / record["train"]["digest"] / "train.csv")
        assert on_host(site, host, cache / record["labels.txt"]["digest"] / "labels.txt")

    # `dtf down` removes the cluster's files and keeps the cache.
    assert site.dtf("down").returncode == 0
    assert site.files() == []
    for host in ("a", "b"):
        assert on_host(site, host, site.workdir(host) / ".cache" / "sync" / digest / "train.csv")
    # A new cluster on those hosts finds the data there: nothing is sent.
    inv = with_sync(site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}), [{"path": str(data), "as": "train"}])
    r = site.dtf("up", str(inv))
    assert r.returncode == 0 and "had it already (skipped)" in r.stdout and "sent to" not in r.stdout, r.stdout


def test_sync_errors_are_one_line(local_site: Site):
    site = local_site
    r = site.dtf("sync", str(site.tmp))
    assert_one_line_error(r, 5, "no cluster is up")
    inv = with_sync(site.inventory({"a": {"ps": 1, "workers": 1}}), ["missing-dir"])
    r = site.dtf("up", str(inv))
    assert_one_line_error(r, 3, f"{inv}:", "sync[0]: ", "missing-dir: no such file or directory")
    inv = with_sync(site.inventory({"a": {"ps": 1, "workers": 1}}), [])
    assert site.dtf("up", str(inv)).returncode == 0
    assert_one_line_error(site.dtf("sync", str(site.tmp / "nope")), 2, "nope: no such file or directory")
    assert_one_line_error(site.dtf("sync", str(site.tmp), "--as", "a b"), 2, "--as: expected a name")
    empty = site.tmp / "empty"
    empty.mkdir()
    assert_one_line_error(site.dtf("sync", str(empty)), 2, "no file to send")
