"""`dtf train`'s repair on a Slurm allocation (fake servers: the restart is the point): each
node's feed is one job step, and a task whose supervisor was SIGKILLed is started again on its
node, as `dtf up` again does. (A job that ends is replaced as a whole: test_comeback.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_up_down import FAKE, inventory, left_behind

from helpers import dtf, status_json, stop_train, wait_gone, wait_until
from slurmlab import SlurmLab


def test_a_killed_supervisor_on_a_node_is_started_again(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="mend")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    program = tmp_path / "sleeps.py"
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    log = tmp_path / "train.out"
    with open(log, "w") as out:
        train = subprocess.Popen([sys.executable, "-m", "dtf.cli", "train", str(program)],
                                 env={**os.environ, "DTF_HOME": str(home), **FAKE}, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "started" in log.read_text(), timeout=180)
        before = next(t for t in status_json(home)["tasks"] if t["task"] == "worker:0")
        os.kill(before["pid"], signal.SIGKILL)  # the supervisor: its server goes with it
        wait_gone([before["pid"]])
        wait_until(lambda: "started again (supervisor is gone)" in log.read_text(), timeout=240)
        assert "worker:0 on " in log.read_text(), log.read_text()
        row = next(t for t in status_json(home)["tasks"] if t["task"] == "worker:0")
        assert row["state"] == "alive" and row["pid"] != before["pid"], row
        assert row["recovered"].startswith("restarted by dtf at "), row
        assert train.poll() is None, log.read_text()  # the program went on
    finally:
        stop_train(train)
        dtf("down", home=home, env=FAKE, timeout=120)
    assert "Traceback" not in log.read_text(), log.read_text()
    assert left_behind(slurm_lab, timeout=30) == []
