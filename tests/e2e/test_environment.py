"""Managed environments on the SSH lab: a host whose only python is /usr/bin/python3 (Debian's,
no TensorFlow, no pip) gets an environment from the laptop's wheels (the lab's hosts reach no
package index) and trains; a build killed before it finished is never used and is rebuilt; a second `up`
reuses it; `down` keeps it and `down --purge` removes it. Bad input gets one line per host.

Each TensorFlow environment costs a uv install of about 1.5 GB on the host (tens of seconds on
two cores): the tests that build one are few. The laptop's wheel cache (DTF_CACHE, default
~/.cache/dtf) is downloaded once from the package index (about 350 MB).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import EXAMPLES, assert_one_line_error, dtf, leftovers, pids_alive, server_process

BARE_PYTHON = "/usr/bin/python3"  # Debian's python: no TensorFlow, no pip packages

pytestmark = [pytest.mark.lab]


def _bare_python_ok() -> bool:
    if not os.access(BARE_PYTHON, os.X_OK):
        return False
    r = subprocess.run([BARE_PYTHON, "-c", "import tensorflow"], capture_output=True, timeout=60)
    return r.returncode != 0


needs_bare = pytest.mark.skipif(not _bare_python_ok(), reason=f"{BARE_PYTHON} missing, or has TensorFlow")


def _env_dirs(workdir: str) -> list[Path]:
    root = Path(workdir, ".cache", "env")
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".uv-cache")) if root.is_dir() else []


def _kill_build(lab, host: str, deadline: float, up: subprocess.Popen) -> list[int]:
    """Wait until uv has begun installing the packages on the host (the environment is created,
    not complete), then SIGKILL the build (launcher and uv), as a reboot or the OOM killer would.
    Not a fixed sleep, and at the install's start rather than half-way through it: an install that
    ended before the kill would fail the test saying so, and what it would have unpacked is CPU
    the test does not need."""
    needle = str(Path(lab.host(host).workdir, ".cache", "env"))
    while time.monotonic() < deadline:
        procs = [(pid, cmd) for pid, cmd in lab.processes(needle) if " install " in cmd or " env " in cmd]
        if any(" install " in cmd for _, cmd in procs):
            alive = pids_alive([pid for pid, cmd in procs if " install " in cmd])
            assert alive, "the environment build ended before the test could kill it"
            for pid, _ in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return [pid for pid, _ in procs]
        if up.poll() is not None:
            raise AssertionError(f"`dtf up` ended ({up.returncode}) before the environment build began:\n"
                                 f"{up.stderr.read() if up.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError("the environment build never started")


@needs_bare
@pytest.mark.tf
@pytest.mark.slow
def test_managed_hosts_build_copy_rebuild_train_reuse_purge(lab, write_inventory, home, tmp_path):
    ps, w0, w1, w2 = lab.ports(4)
    h0, h1 = lab.host("h0"), lab.host("h1")
    managed = {"python": "managed", "base_python": BARE_PYTHON}
    inv = write_inventory([{"host": "h0", **managed, "ps": [ps], "workers": [w0]},
                           {"host": "h1", **managed, "workers": [w1]},
                           {"host": "h2", "workers": [w2]}])  # a user-managed python beside them
    # (Cold: no environment of another test's on these hosts: another module may have built one there.)
    for h in (h0, h1):
        shutil.rmtree(Path(h.workdir, ".cache"), ignore_errors=True)
    # 1. Cold: the laptop sends the wheels to one host, the other copies them from it. h0's build
    # is killed as it installs: `up` fails with one line for h0, and rolls back.
    up = subprocess.Popen([sys.executable, "-m", "dtf.cli", "up", str(inv)],
                          env={**os.environ, "DTF_HOME": str(home)}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        killed = _kill_build(lab, "h0", time.monotonic() + 600, up)
        out, err = up.communicate(timeout=600)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert killed
    assert up.returncode == 4, (out, err)
    report = err[err.index("dtf: error:"):].splitlines()
    assert len(report) == 2 and report[1].startswith("  h0: the environment build in ") \
        and "was killed before it finished; the next `dtf up` builds it again" in report[1], err
    assert re.search(r"h[01]: copying 40 files from h[01]", err), err  # uv and 39 wheels: one uplink transfer
    half = _env_dirs(h0.workdir)
    assert half and not (half[0] / ".dtf-env.json").exists()  # half-built, never marked complete
    assert leftovers(lab) == {}

    # 2. The next `up` removes h0's half-built environment and builds it again (its wheels are
    # on the host: nothing sent); h1's, complete, is reused.
    r = dtf("up", str(inv), home=home, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = {h: next(x for x in r.stdout.splitlines() if x.startswith(f"{h}: managed environment")) for h in ("h0", "h1")}
    assert re.match(r"h0: managed environment \S+/\.cache/env/\w+: built in [\d.]+s \(resolve [\d.]+s, send [\d.]+s, "
                    r"create [\d.]+s, install [\d.]+s\), [\d.]+ GB on disk$", line["h0"]), line  # nothing sent
    assert line["h1"].endswith(": reused (found complete by the check)"), line
    env = _env_dirs(h0.workdir)
    assert len(env) == 1 and (env[0] / ".dtf-env.json").exists()
    marker = json.loads((env[0] / ".dtf-env.json").read_text())
    assert "tensorflow-cpu==2.21.0" in marker["requirements"] and "tf-keras==2.21.0" in marker["requirements"]
    assert not any(p.startswith("tensorflow==") for p in marker["requirements"])  # one TensorFlow only
    serving = [cmd for pid, cmd in lab.processes("h0") if server_process(pid, cmd, "serve")]
    assert serving and all(cmd.startswith(str(env[0] / "bin" / "python")) for cmd in serving)

    r = dtf("train", "--output", str(tmp_path / "loop"), str(EXAMPLES / "custom_loop.py"), "--epochs", "1",
            home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((tmp_path / "loop" / "summary.json").read_text())["steps"] == 50

    # 3. `down` keeps the environments; a second `up` reuses them after one check (with fake
    # servers, run by the environments' python: what this `up` is about is the environments).
    assert dtf("down", home=home, timeout=120).returncode == 0
    assert (env[0] / ".dtf-env.json").exists()
    r = dtf("up", str(inv), home=home, timeout=300, env={"DTF_SERVER": "fake"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(": reused (found complete by the check)") == 2, r.stdout

    # 4. `down --purge` removes WORKDIR/.cache (environments and wheels) on every host.
    r = dtf("down", "--purge", home=home, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "h0: cache removed" in r.stdout and "h1: cache removed" in r.stdout, r.stdout
    assert not Path(h0.workdir, ".cache").exists() and not Path(h1.workdir, ".cache").exists()
    assert leftovers(lab) == {}


@needs_bare
def test_no_python3_on_the_host_is_one_line(lab, write_inventory, home):
    ps, w0 = lab.ports(2)
    inv = write_inventory([{"host": "h0", "ps": [ps], "python": "managed", "base_python": "/nonexistent/bin/python3"},
                           {"host": "h1", "workers": [w0], "python": "managed", "base_python": BARE_PYTHON,
                            "workdir": "/srv/dtf-env-disk"}])
    # h1's workdir is a 30 MB disk of its own (a tmpfs in its mount namespace): far too small.
    assert lab.run("h1", ["mkdir", "-p", "/srv/dtf-env-disk"]).returncode == 0
    mount = lab.run("h1", ["mount", "-t", "tmpfs", "-o", "size=30m", "dtf-env-disk", "/srv/dtf-env-disk"])
    assert mount.returncode == 0, mount.stderr
    try:
        r = dtf("up", str(inv), home=home, timeout=600)
    finally:
        lab.run("h1", ["umount", "/srv/dtf-env-disk"])
    err = assert_one_line_error(r, 4, "dtf up failed on 2 host(s)",
                                "h0: no python3 on the host (looked for '/nonexistent/bin/python3'",
                                "h1: disk full: ", "free for /srv/dtf-env-disk/.cache/env/")
    report = err[err.index("dtf: error:"):].splitlines()
    assert len(report) == 3, report  # the summary, then one line per host
    assert leftovers(lab) == {}
