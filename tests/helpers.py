"""Running the real `dtf` command in a subprocess, as a user would, for end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
NOISE = ("I0000 ", "W0000 ", "E0000 ", "WARNING: All log messages")


def dtf(*args: str, home: Path, timeout: float = 300, env: dict | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `dtf ARGS` with DTF_HOME=home; never hangs (timeout)."""
    full_env = {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dtf.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO, stdin=subprocess.DEVNULL)


def status_json(home: Path) -> dict:
    r = dtf("status", "--json", home=home, timeout=60)
    return json.loads(r.stdout)


def assert_one_line_error(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command failed with `code`, said why on stderr, and showed no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.startswith("dtf: error:") or "dtf: error:" in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
    return r.stderr


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def leftovers(lab) -> dict[str, list]:
    """Processes still running from any lab host's dtf workdir."""
    return {h.name: p for h in lab.hosts if (p := lab.processes(h))}
