"""The Slurm lab itself: what every Slurm test builds on."""

from __future__ import annotations

import subprocess

from slurmlab import STUCK, SlurmLab


def test_srun_from_the_login_host_runs_on_both_compute_hosts(slurm_lab: SlurmLab) -> None:
    r = subprocess.run(slurm_lab.ssh_argv(slurm_lab.login, "srun", "-N2", "hostname"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["h1", "h2"]


def test_the_laptop_reaches_only_the_login_hosts_ssh(slurm_lab: SlurmLab) -> None:
    r = subprocess.run(slurm_lab.ssh_argv(slurm_lab.computes[0], "true"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 255 and "port 22" in r.stderr, r.stderr
    # ...while the login host reaches the compute hosts (Slurm's own traffic, and the tasks').
    connect = f"import socket; socket.create_connection(('{slurm_lab.computes[0].address}', 22), 5)"
    r = slurm_lab.run(slurm_lab.login, ["python3", "-c", connect], timeout=10)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_job_in_the_stuck_partition_pends_until_cancelled(slurm_lab: SlurmLab) -> None:
    r = slurm_lab.slurm(["sbatch", "--parsable", "-p", STUCK, "--wrap", "sleep 100"])
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        assert f"{job} PENDING" in slurm_lab.queue()
    finally:
        slurm_lab.slurm(["scancel", job])
    assert not [j for j in slurm_lab.queue() if j.startswith(f"{job} ")]
