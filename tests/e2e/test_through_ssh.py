"""Real TensorFlow through SSH: a laptop that reaches the lab's hosts on port 22 only (a firewall
rule in its own namespace) trains with `network: ssh`, picked by `auto`; a killed SSH master is
re-established while the coordinator retries; nothing is left on the laptop or the hosts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from dtf.hosts.control import host_path
from helpers import EXAMPLES, Barrier, Train, dtf, leftovers, ssh_processes, status_json, wait_gone

pytestmark = [pytest.mark.lab, pytest.mark.tf]


def logins(lab) -> dict[str, int]:
    """SSH logins each sshd of the lab accepted so far (its log, LogLevel VERBOSE)."""
    return {h.name: (lab.root / h.name / "sshd.log").read_text(errors="replace").count("Accepted publickey")
            for h in lab.hosts}


def master_pid(path: str) -> int:
    """The process of the control master at `path` (OpenSSH renames it "ssh: PATH [mux]")."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if (argv[0].startswith("ssh: ") or Path(argv[0]).name == "ssh") and "-W" not in argv \
                    and any(path in a for a in argv):
                return int(pid)
    raise AssertionError(f"no master at {path}")


def test_laptop_behind_port_22_trains_through_ssh_and_survives_a_killed_master(lab, write_inventory, home, tmp_path):
    if lab.mode != "netns":
        pytest.skip("blocking the laptop needs network namespaces")
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    with lab.laptop_blocked():
        t0 = time.monotonic()
        r = dtf("up", str(inv), home=home, timeout=180)
        print(f"up (auto -> ssh) {time.monotonic() - t0:.1f}s")
        assert r.returncode == 0, r.stderr
        assert "network: ssh; the TF ports are closed to this machine" in r.stdout
        assert status_json(home)["network"] == "ssh"

        # The fit example, relative output path: checkpoints and SavedModel land on the laptop.
        epochs = 4
        before = logins(lab)
        # The program waits at the end of epoch 2 until the master is dead: the kill lands mid-training.
        barrier = Barrier(tmp_path / "barrier", r"^epoch 2/\d+ done")
        run = Train(home, tmp_path / "train.out", "--output", "fit",
                    *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(epochs), "--steps-per-epoch", "30"),
                    cwd=tmp_path)
        with barrier.held(run):
            # The run goes over the cluster's control masters, kept since `up`: no new handshake.
            assert ssh_processes() == [] and logins(lab) == before, (before, logins(lab))
            victim = master_pid(host_path(home, "lab", "h1"))
            os.kill(victim, signal.SIGKILL)  # a dropped SSH connection: its channels go with it
            wait_gone([victim])
            killed = time.monotonic()
        seen = len(re.findall(r"^epoch \d+/\d+ done", run.text(), re.M))
        run.wait_for(rf"^epoch {seen + 1}/\d+ done", timeout=300)
        print(f"training flowing again {time.monotonic() - killed:.1f}s after the SSH master of h1 was killed")
        code, text = run.finish(timeout=400)
        assert code == 0, text[-5000:]
        s = json.loads((tmp_path / "fit" / "summary.json").read_text())
        assert s["final_loss"] < 0.5 * s["first_loss"], s
        assert Path(s["saved_model"], "saved_model.pb").exists()
        assert list((tmp_path / "fit" / "checkpoints").glob("ckpt-*.index"))
        assert ssh_processes() == []  # the proxy and its channels ended with `dtf train`
        # h1's master was started again (one handshake), by the proxy's next CONNECT, or else by this
        # status: the run can end on h2's worker before TensorFlow reconnects to h1's
        assert dtf("status", home=home, timeout=120).returncode == 0
        assert {h: n - before[h] for h, n in logins(lab).items()} == {"h0": 0, "h1": 1, "h2": 0}
        t0 = time.monotonic()
        assert dtf("down", home=home, timeout=120).returncode == 0
        print(f"down (ssh) {time.monotonic() - t0:.1f}s")
    assert leftovers(lab) == {} and ssh_processes() == []
