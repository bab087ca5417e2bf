"""`dtf train`'s repair on fake servers, on local processes and on the SSH lab: it reads the hosts'
push feed (one `top --states-only` stream per host, dtf.hostops.watch) and starts again a task
whose supervisor was killed. (With TensorFlow, and the moves to a spare: tests/e2e/test_outlive.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_lifecycle import up_with_program

from helpers import status_json, stop_train, wait_gone, wait_until
from sites import Site


def fed(site: Site) -> set[str]:
    """The cluster directories a `top --states-only` streams from now (one per host)."""
    return {cmd.split(" top --dir ")[1].split()[0] for _, cmd in site.processes()
            if " top --dir " in cmd and "--states-only" in cmd}


def test_a_killed_supervisor_is_started_again_from_the_hosts_feed(site: Site, tmp_path: Path):
    program = up_with_program(site, tmp_path, {"a": {"ps": 1}, "b": {"workers": 1}})
    log = tmp_path / "train.out"
    with open(log, "w") as out:
        train = subprocess.Popen([sys.executable, "-m", "dtf.cli", "train", str(program), "sleep"],
                                 env=site.env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until(lambda: "attempt 1" in log.read_text(), timeout=120)
        # The repair's feed: one `top --states-only` on each host, for the whole run.
        wait_until(lambda: len(fed(site)) == 2, timeout=120)
        before = next(r for r in status_json(site.home)["tasks"] if r["task"] == "worker:0")
        os.kill(before["pid"], signal.SIGKILL)  # the supervisor: its server goes with it (PDEATHSIG)
        wait_gone([before["pid"]])
        wait_until(lambda: "worker:0 on " in log.read_text() and "started again (supervisor is gone)" in log.read_text(),
                   timeout=180)
        row = next(r for r in status_json(site.home)["tasks"] if r["task"] == "worker:0")
        assert row["state"] == "alive" and row["pid"] != before["pid"], row
        assert row["recovered"].startswith("restarted by dtf at ") and "(supervisor is gone)" in row["recovered"], row
        assert train.poll() is None, log.read_text()  # the program went on: a worker came back at its address
    finally:
        stop_train(train)
    assert "Traceback" not in log.read_text(), log.read_text()
