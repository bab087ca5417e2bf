"""What `dtf status` and `dtf train` say when Slurm takes the allocation away: one line with
Slurm's reason (fake servers: TensorFlow is not the point)."""

from __future__ import annotations

import time
from pathlib import Path

from test_up_down import FAKE, inventory, job_of, left_behind, ours

from helpers import assert_one_line_error, dtf
from slurmlab import SlurmLab


def test_a_lost_node_is_said_in_one_line(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="lost")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    lost = slurm_lab.computes[1]
    program = tmp_path / "prog.py"
    program.write_text("raise SystemExit('never run')\n")
    slurm_lab.kill_slurmd(lost)
    try:
        # slurmctld marks the node DOWN after SlurmdTimeout, and ends the job (NODE_FAIL): wait for it
        deadline = time.monotonic() + 180
        while ours(slurm_lab, job) and time.monotonic() < deadline:
            time.sleep(1)
        assert ours(slurm_lab, job) == []
        r = dtf("status", home=home, env=FAKE, timeout=60)
        assert_one_line_error(r, 7, f"slurm job {job} lost a node (NODE_FAIL", f"node {lost.name} DOWN",
                              "Not responding", "its tasks ended with it")
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stdout + r.stderr
        r = dtf("train", str(program), home=home, env=FAKE, timeout=60)
        # On a loaded machine Slurm may have forgotten the job by now (the lab's MinJobAge is 10 s):
        # dtf then says that it left the queue, which is as true.
        forgotten = f"slurm job {job} is no longer in the queue, and Slurm no longer says why"
        if forgotten not in r.stderr:
            assert_one_line_error(r, 7, f"slurm job {job} lost a node (NODE_FAIL", f"node {lost.name} DOWN")
        else:
            assert_one_line_error(r, 7, forgotten)
        r = dtf("down", home=home, env=FAKE, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"job {job} is no longer in the queue" in r.stdout
    finally:
        slurm_lab.restart_slurmd(lost)
    assert left_behind(slurm_lab, timeout=30) == []
