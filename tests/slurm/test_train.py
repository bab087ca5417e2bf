"""`dtf train` on the Slurm lab with real TensorFlow: the laptop reaches only the login host's
port 22, so every connection from the program to a task goes through the login host's one SSH
master, and the tasks reach the coordinator back through the relay on the login host."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from test_up_down import inventory, job_of, left_behind, ours

from helpers import REPO, dtf
from slurmlab import SlurmLab

pytestmark = pytest.mark.tf
EXAMPLES = REPO / "examples"


def relays(lab: SlurmLab) -> list[str]:
    """dtf's relays back to the coordinator (on the login host) for this lab's nodes: their command
    lines hold its source and the nodes' addresses (another test run's Slurm lab on the same
    machine has relays of its own)."""
    ours = re.compile("|".join(rf" {re.escape(h.address)}(?![\d.])" for h in lab.computes))
    return [cmd for _, cmd in lab.processes("def facing(address") if ours.search(cmd)]


def test_train_through_the_login_host(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="fit")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    r = dtf("status", "--json", home=home, timeout=60)
    assert json.loads(r.stdout)["network"] == "ssh", r.stdout  # auto: the nodes' TF ports refuse the laptop
    # Relative output paths, from the laptop's working directory: what a server wrote instead of
    # the coordinator would land on a node's own disk, not here. Short: 2 epochs of 20 steps.
    r = dtf("train", str(EXAMPLES / "mnist_fit.py"), "--output", "fit", "--epochs", "2", "--steps-per-epoch", "20",
            home=home, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "fit"
    s = json.loads((out / "summary.json").read_text())
    assert s["final_loss"] < s["first_loss"], s
    assert Path(s["saved_model"], "saved_model.pb").exists()  # landed on the laptop
    assert list((out / "checkpoints").glob("ckpt-*.index"))
    assert relays(slurm_lab) == []  # it ended with `dtf train`
    r = dtf("status", home=home, timeout=60)
    assert r.returncode == 0 and r.stdout.count(" alive ") == 4, r.stdout + r.stderr
    t0 = time.monotonic()
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"\ndtf down: {time.monotonic() - t0:.1f}s")
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []
