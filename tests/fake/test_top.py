"""`dtf top` against fake servers: one snapshot for scripts (--once, --json) on local processes;
as a person sees it, in a terminal multiplexer (tmux: the screen captured, `q` or Ctrl-C sent, the
pane clean afterwards); and on the SSH lab, that refreshing costs no new SSH connection."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import REPO, stop_train, wait_until
from lab import Lab
from sites import LabSite, Site


def top_json(site: Site) -> tuple[int, dict]:
    r = site.dtf("top", "--json", timeout=90)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def test_once_and_json_on_a_local_cluster(local_site: Site):
    site = local_site
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}}, restart_limit=0)
    assert site.dtf("up", str(inv)).returncode == 0
    code, doc = top_json(site)
    assert code == 0, doc
    assert (doc["schema"], doc["cluster"], doc["training"]) == (1, "fk", None)
    assert doc["summary"]["states"] == {"alive": 3} and doc["summary"]["hosts"] == 2
    for row in doc["tasks"]:
        # Two samples per host were taken: the rates are known.
        assert row["cpu"] is not None and row["rss"] > 0 and row["net_in"] is not None, row
        assert row["uptime"] is not None and row["error"] is None
    # Collective mode: a copy's figures, in its task's directory, come with its host's samples.
    live = site.home / "live" / "fk"
    live.mkdir(parents=True)
    (live / "run.json").write_text(json.dumps({"schema": 1, "kind": "collective", "pid": os.getpid(), "attempt": 1,
                                               "attempts": 3, "copies": {}}))
    (site.workdir("a") / "fk" / "worker-0" / "train.json").write_text(json.dumps({"steps": 9, "steps_per_s": 4.5}))
    code, doc = top_json(site)
    assert {r["task"]: r["steps_per_s"] for r in doc["tasks"]} == {"ps:0": None, "worker:0": 4.5, "worker:1": None}
    assert doc["training"]["steps_per_s"] == 4.5
    (live / "run.json").unlink()
    # A task whose server died and whose supervisor gave up: first on the screen, exit 7.
    site.crash("b", "worker-1")
    os.kill(site.supervisor("b", "worker-1")["server_pid"], 9)
    wait_until(lambda: site.supervisor("b", "worker-1").get("state") == "failed")
    r = site.dtf("top", "--once", timeout=90)
    assert r.returncode == 7, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("cluster fk: 3 tasks on 2 hosts: 1 failed, 2 alive"), lines
    assert lines[3].split()[:3] == ["b", "worker:1", "failed:"], lines
    # Not a terminal and no --once: one line, no traceback.
    r = site.dtf("top")
    assert r.returncode == 2 and r.stderr.startswith("dtf: error: dtf top: not a terminal"), r.stderr


class Tmux:
    """A tmux server of the test's own (its own socket), one session running a command."""

    def __init__(self, tmp: Path) -> None:
        self.socket = f"dtftop-{uuid.uuid4().hex[:8]}"
        self.status = tmp / "tmux-exit-status"  # tmux's own #{pane_dead_status} comes late, or never

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=15)

    def start(self, command: str, env: dict[str, str], width: int = 160, height: int = 30) -> None:
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        r = self("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                 f"cd {REPO} && env -u COLUMNS -u LINES {exports} {command}; echo $? > {self.status}",
                 ";", "set-option", "-t", "t", "remain-on-exit", "on")
        assert r.returncode == 0, r.stderr

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t").stdout

    def exit_code(self) -> int | None:
        """The command's exit code once it ended (None while it runs)."""
        text = self.status.read_text().strip() if self.status.exists() else ""
        return int(text) if text else None

    def close(self) -> None:
        self("kill-server")


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no tmux (CI=true: `apt-get install tmux`, .ci/run does it)")
        pytest.skip("no tmux: apt-get install tmux")
    t = Tmux(tmp_path)
    try:
        yield t
    finally:
        t.close()


def dtf_top(site: Site, interval: float) -> tuple[str, dict[str, str]]:
    env = {"DTF_HOME": str(site.home), "DTF_SERVER": "fake", "TERM": "xterm-256color"}
    return f"{sys.executable} -m dtf.cli top --interval {interval:g}", env


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_top_as_a_person_sees_it_in_tmux(local_site: Site, tmux: Tmux, key: str):
    site = local_site
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    tmux.start(*dtf_top(site, 0.3))
    screen = wait_until(lambda: s if "alive" in (s := tmux.screen()) and "%" in s else None, timeout=60)
    lines = [line for line in screen.splitlines() if line.strip()]
    assert lines[0].startswith("cluster fk: 3 tasks on 2 hosts: 3 alive | cpu "), screen
    assert lines[1] == "training: none (no `dtf train` running)", screen
    assert lines[2].split() == ["host", "task", "state", "restarts", "last", "exit", "uptime", "cpu", "mem",
                                "net", "in", "net", "out", "steps/s"], screen
    assert [line.split()[:3] for line in lines[3:6]] == [["a", "ps:0", "alive"], ["worker:0", "alive", "0"],
                                                          ["b", "worker:1", "alive"]], screen
    assert lines[-1].strip() == "q: quit", screen
    assert tmux.exit_code() is None, "dtf top ended on its own"
    tmux("send-keys", "-t", "t", key)
    wait_until(lambda: tmux.exit_code() is not None, timeout=20)
    after = tmux.screen()
    assert tmux.exit_code() == 0, after
    # The alternate screen is gone: nothing of the view is left on the pane.
    assert "cluster fk" not in after and "q: quit" not in after and "alive" not in after, after


def _uptime(text: str) -> float | None:
    m = re.search(r"ps:0\s+alive\s+\d+\s+\S+\s+(?:(\d+)m)?(\d+)s", text)
    return None if m is None else int(m.group(1) or 0) * 60 + int(m.group(2))


@pytest.fixture
def lab_site(tmp_path: Path, lab: Lab) -> Iterator[LabSite]:
    the_site = LabSite(tmp_path, lab)
    try:
        yield the_site
    finally:
        the_site.cleanup()


@pytest.mark.lab
def test_refreshing_opens_no_new_ssh_connection(lab_site: LabSite, lab: Lab, tmux: Tmux):
    site = lab_site
    inv = site.inventory({"a": {"ps": 1, "workers": 1}, "b": {"workers": 1}})
    assert site.dtf("up", str(inv)).returncode == 0
    logs = {h: lab.root / h / "sshd.log" for h in ("h0", "h1")}

    def connections() -> dict[str, int]:
        return {h: log.read_text(errors="replace").count("Connection from ") for h, log in logs.items()}

    before = connections()
    tmux.start(*dtf_top(site, 0.2))
    first = wait_until(lambda: _uptime(tmux.screen()), timeout=60)
    shown = connections()
    # At least 4 s of refreshes every 0.2 s (the ps's uptime, as the host reports it, moves on).
    wait_until(lambda: (u := _uptime(tmux.screen())) is not None and u >= first + 4, timeout=60)
    during = connections()
    # The view costs at most one connection per host (none while the cluster's control master,
    # kept since `up`, is open: its samples come over it), and refreshing costs none.
    assert during == shown, (before, shown, during)
    assert all(during[h] - before[h] <= 1 for h in logs), (before, during)
    tmux("send-keys", "-t", "t", "q")
    wait_until(lambda: tmux.exit_code() is not None, timeout=20)
    assert tmux.exit_code() == 0


@pytest.mark.lab
def test_the_view_follows_tasks_moved_to_a_spare(lab: Lab, tmux: Tmux, tmp_path: Path):
    """Under `dtf train`, h1 is lost for good and its task moves to the spare h2: the open view
    shows it there, with what dtf did."""
    if lab.mode != "netns":
        pytest.skip("cutting one host off needs network namespaces (lab in loopback mode)")
    import signal

    import yaml

    from helpers import Train, down_recorded, dtf, leftovers, wait_gone

    home = tmp_path / "home"
    ps, w0 = lab.ports(2)
    inv = lab.inventory(tmp_path / "inv.yaml", [{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    doc = yaml.safe_load(inv.read_text())
    doc.update(host_timeout=10, spares=[{"host": "h2", "workdir": lab.host("h2").workdir}])
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    fake = {"DTF_SERVER": "fake"}
    program = tmp_path / "waits.py"  # the program never reaches the (fake) servers: it waits
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    run = None
    try:
        assert dtf("up", str(inv), home=home, timeout=120, env=fake).returncode == 0
        run = Train(home, tmp_path / "train.out", str(program))
        run.wait_for("^started")
        tmux.start(f"{sys.executable} -m dtf.cli top --interval 0.5",
                   {"DTF_HOME": str(home), "TERM": "xterm-256color", **fake})
        wait_until(lambda: re.search(r"h1\s+worker:0\s+alive", tmux.screen()), timeout=60)
        lab.link_down("h1")
        pids = [pid for pid, _ in lab.processes("h1")]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_gone(pids)
        run.wait_for(r"worker:0 moved to spare h2", timeout=120)
        screen = wait_until(lambda: s if re.search(r"h2\s+worker:0\s+alive \(moved from h1 to spare h2\)",
                                                   s := tmux.screen()) else None, timeout=60)
        assert not [line for line in screen.splitlines() if line.split()[:1] == ["h1"]], screen  # h1 left the view
        tmux("send-keys", "-t", "t", "q")
        wait_until(lambda: tmux.exit_code() is not None, timeout=20)
        assert tmux.exit_code() == 0
    finally:
        if run is not None:
            stop_train(run.proc)
        lab.link_up("h1")
        shutil.rmtree(Path(lab.host("h1").workdir, "lab"), ignore_errors=True)
        down_recorded(tmp_path)
    assert leftovers(lab) == {}
