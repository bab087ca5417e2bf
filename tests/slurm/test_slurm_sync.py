"""`dtf sync` on the Slurm lab, with fake servers: the nodes are reached only through job steps
(no SSH to them, each node's workdir on its own disk), and `dtf down --purge` leaves nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

from test_up_down import FAKE, inventory, job_of, left_behind, ours, workdir

from helpers import dtf
from slurmlab import SlurmLab


def on_node(lab: SlurmLab, job: str, node: str, script: str) -> str:
    """`sh -c script` on a node, as a job step of `job` (a job of its own: ""), on the node's own
    disk (its slurmd's tmpfs)."""
    where = [f"--jobid={job}", "--overlap"] if job else []
    r = lab.slurm(["srun", "--quiet", *where, "-N1", "-n1", f"-w{node}", "sh", "-c", script], timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def digests(root: Path) -> str:
    """`sha256sum` lines of every file below root, by relative path, sorted (as on a node)."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return "".join(f"{hashlib.sha256((root / f).read_bytes()).hexdigest()}  ./{f}\n" for f in files)


def test_sync_reaches_every_node_and_purge_leaves_nothing(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("alpha\n")
    (data / "sub" / "b.bin").write_bytes(bytes(range(256)) * 400)
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="sy")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    r = dtf("sync", str(data), home=home, env=FAKE, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "synced data (2 file(s)" in r.stdout, r.stdout
    # over the laptop's uplink once: the second node copied it from the first, node to node
    assert "h2 copied it from other hosts" in r.stdout, r.stdout
    cache = f"{workdir(slurm_lab)}/.cache/sync"
    for node in (h.name for h in slurm_lab.computes):
        got = on_node(slurm_lab, job, node, f'cd {cache}/*/ && find . -type f | LC_ALL=C sort | xargs sha256sum')
        assert got == digests(data), (node, got)
    r = dtf("sync", str(data), home=home, env=FAKE, timeout=120)  # every node has it: nothing sent
    assert r.returncode == 0 and "had it already" in r.stdout, r.stdout + r.stderr
    r = dtf("down", "--purge", home=home, env=FAKE, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": cache removed") == 2, r.stdout
    assert ours(slurm_lab, job) == [] and left_behind(slurm_lab) == []
    # Nothing of this cluster's, and no cache, on either node's disk (other tests' clusters share
    # the workdir): seen through a job of our own (srun waits for its nodes).
    for node in (h.name for h in slurm_lab.computes):
        where = f"{workdir(slurm_lab)}/sy {workdir(slurm_lab)}/.cache"
        assert on_node(slurm_lab, "", node, f"ls -d {where} 2>/dev/null || true") == ""
