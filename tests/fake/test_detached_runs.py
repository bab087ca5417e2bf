"""Detached runs (`dtf train --detach`, `dtf attach`) on fake servers, on local processes and on the
SSH lab: the coordinator's program prints numbered lines (tests/e2e/programs/count.py) and needs no
TensorFlow, so what is checked is dtf's own part: each line printed once however often attach is
interrupted, the program's exit code, `down` refused while the run runs and `--stop-run`, the lease
held while it runs and lapsing after, the cluster key on the other hosts and its removal, a lost
host's tasks moved to a spare by the coordinator.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import PROGRAMS, as_in_a_terminal, dtf, wait_until
from sites import CLUSTER, FAKE, LabSite, Site

COUNT = PROGRAMS / "count.py"


def work_dir(tmp_path: Path) -> Path:
    """The laptop's working directory a run is started from, with the program in it."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    shutil.copy(COUNT, work / "count.py")
    return work


def detach(site: Site, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    r = dtf("train", "--detach", "count.py", *args, home=site.home, env=FAKE, cwd=work, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "runs detached on" in r.stderr, r.stderr
    return r


def attach(site: Site, work: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return dtf("attach", *args, home=site.home, env=FAKE, cwd=work, timeout=timeout)


def output_log(site: Site) -> str:
    """The run's output as its host keeps it (the lab's workdirs are on this machine's disk)."""
    return (site.workdir("a") / CLUSTER / "detached" / "output.log").read_text()


def chief(site: Site) -> dict:
    return site.supervisor("a", "chief-0")


def up(site: Site, inv: Path, *args: str) -> None:
    r = site.dtf("up", str(inv), *args, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


def test_attach_interrupted_again_and_again_prints_every_line_once(site, tmp_path):
    up(site, site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}))
    work = work_dir(tmp_path)
    detach(site, work, "150", "0.04", "3")
    printed: list[str] = []
    interrupted = 0
    for _ in range(80):
        proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "attach"], env=site.env(), cwd=work,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=as_in_a_terminal)
        got: list[str] = []
        reader = threading.Thread(target=lambda p=proc, g=got: g.extend(iter(p.stdout.readline, "")))
        reader.start()
        # Ctrl-C once it has printed a few lines of its own (or it ends by itself: the run ended).
        deadline = time.monotonic() + 60
        while len(got) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=10)  # (stdout is the reader's alone: every line it got, in order)
        assert proc.stderr is not None
        err = proc.stderr.read()
        printed += got
        if proc.returncode != 130:
            break
        interrupted += 1
        assert "detached from the run on" in err and "Traceback" not in err, err
    assert proc.returncode == 3, err  # the program's own exit code
    assert interrupted >= 5, interrupted
    assert "".join(printed) == output_log(site)
    lines = [line for line in printed if line.startswith("line ")]
    assert lines == [f"line {i} of 150 (attempt 1)\n" for i in range(1, 151)]
    # The last 2 lines again on demand; the cursor is at the end already.
    r = attach(site, work, "-n", "2")
    assert r.returncode == 3 and r.stdout.splitlines() == output_log(site).splitlines()[-2:], r.stdout + r.stderr
    r = attach(site, work)
    assert r.returncode == 3 and r.stdout == "" and "fetched into" in r.stderr, r.stdout + r.stderr


def test_down_refuses_while_a_detached_run_runs_and_stop_run_stops_it(site, tmp_path):
    up(site, site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}))
    work = work_dir(tmp_path)
    detach(site, work, "3000", "0.05")
    r = dtf("train", "--detach", "count.py", "1", "0", home=site.home, env=FAKE, cwd=work, timeout=60)
    assert r.returncode != 0 and "still runs on" in r.stderr and "Traceback" not in r.stderr, r.stderr
    st = site.dtf("status")
    assert re.search(rf"detached on {site.host('a')}", st.stdout), st.stdout + st.stderr
    r = site.dtf("down")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "--stop-run" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert chief(site).get("state") == "running"
    r = site.dtf("down", "--stop-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dtf: stopping the detached run" in r.stderr and "fetched into" in r.stderr, r.stderr
    assert site.processes() == []
    assert site.files() == []


def test_a_detached_run_holds_the_lease_and_lets_it_lapse_once_it_ended(site, tmp_path):
    """A lease of 8 s, a run of about 20 s, and no dtf command from here meanwhile: the run's own
    coordinator keeps the cluster; once it ended, the lease lapses and every task stops itself,
    the cluster key (SSH hosts) goes with it."""
    up(site, site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}), "--ttl", "8")
    work = work_dir(tmp_path)
    detach(site, work, "40", "0.5")
    lab = site.lab if isinstance(site, LabSite) else None
    if lab is not None:  # b lets the coordinator's host in, as little as it can
        keys = lab.run("h1", ["cat", f"{lab.home('h1', 'root')}/.ssh/authorized_keys"]).stdout
        [line] = [k for k in keys.splitlines() if "dtf-coordinator" in k]
        address = lab.host("h0").address
        assert line.startswith(f'restrict,from="{address}') and 'expiry-time="' in line, line
    wait_until(lambda: chief(site).get("state") == "exited", timeout=120)
    alive = json.loads(site.dtf("status", "--json").stdout)["tasks"]
    assert [t["state"] for t in alive] == ["alive", "alive"], alive  # 20 s past a lease of 8 s
    wait_until(lambda: site.processes() == [], timeout=60)  # the lease lapsed after the run's end
    if lab is not None:
        keys = lab.run("h1", ["cat", f"{lab.home('h1', 'root')}/.ssh/authorized_keys"]).stdout
        assert "dtf-coordinator" not in keys, keys
    # The run's output and what it wrote outlive the lease: attach brings them, down removes them.
    assert not (site.workdir("b") / CLUSTER).exists()
    r = attach(site, work)
    assert r.returncode == 0 and r.stdout.count("line ") == 40, r.stdout + r.stderr
    assert (work / "count.txt").read_text() == "40 lines, attempt 1\n"
    r = site.dtf("down")
    assert r.returncode == 0, r.stdout + r.stderr
    assert site.processes() == [] and site.files() == []


@pytest.mark.lab
def test_a_host_lost_while_detached_has_its_tasks_moved_to_a_spare_by_the_coordinator(netns_site, tmp_path):
    site = netns_site
    lab = site.lab
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    doc = yaml.safe_load(inv.read_text())
    doc["spares"] = [{"host": "h2", "workdir": lab.host("h2").workdir}]
    doc["host_timeout"] = 5
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    up(site, inv)
    work = work_dir(tmp_path)
    detach(site, work, "100", "0.2")
    keys = f"{lab.home('h2', 'root')}/.ssh/authorized_keys"
    [line] = [k for k in lab.run("h2", ["cat", keys]).stdout.splitlines() if "dtf-coordinator" in k]
    assert 'expiry-time="' in line, line  # the spare lets the coordinator in, until the lease's end
    wait_until(lambda: "line 5 of" in output_log(site), timeout=60)
    lab.link_down("h1")
    try:
        wait_until(lambda: "moved to spare h2" in output_log(site), timeout=120)
    finally:
        lab.link_up("h1")
    r = attach(site, work, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(attempt 2)" in r.stdout, r.stdout
    tasks = json.loads(site.dtf("status", "--json").stdout)["tasks"]
    assert [(t["task"], t["host"], t["state"]) for t in tasks] == [("ps:0", "h0", "alive"), ("worker:0", "h2", "alive")]
    r = site.dtf("down")
    assert r.returncode == 0, r.stdout + r.stderr
    assert lab.processes("h1") == [] and lab.processes("h2") == []
    for host in ("h1", "h2"):  # the retired host and the spare: nothing of the cluster, no key line
        assert "dtf-coordinator" not in lab.run(host, ["cat", f"{lab.home(host, 'root')}/.ssh/authorized_keys"]).stdout
        assert not Path(lab.host(host).workdir, CLUSTER).exists()


def test_detach_says_what_it_cannot_do_in_one_line(local_site, tmp_path):
    site = local_site
    up(site, site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}))
    work = work_dir(tmp_path)
    (work / "notebook.ipynb").write_text("{}")
    for args, needle in [(["notebook.ipynb"], "a notebook runs attached"),
                         (["--collective", "count.py", "1", "0"], "--collective: not supported"),
                         (["needs_a_module.py"], "has no no_such_module_here")]:
        if args == ["needs_a_module.py"]:
            (work / "needs_a_module.py").write_text("import no_such_module_here\n")
        r = dtf("train", "--detach", *args, home=site.home, env=FAKE, cwd=work, timeout=60)
        assert r.returncode != 0 and needle in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = dtf("attach", home=site.home, env=FAKE, cwd=work, timeout=60)
    assert r.returncode != 0 and "has no detached run" in r.stderr, r.stderr


def test_a_program_folder_too_large_to_send_is_refused_naming_its_size(local_site, tmp_path, monkeypatch):
    site = local_site
    up(site, site.inventory({"a": {"ps": 1}, "b": {"workers": 1}}))
    work = work_dir(tmp_path)
    with open(work / "data.bin", "wb") as f:
        f.truncate(int(os.environ.get("DTF_TEST_BIG", str(201 * 2**20))))
    r = dtf("train", "--detach", "count.py", "1", "0", home=site.home, env=FAKE, cwd=work, timeout=120)
    assert r.returncode != 0, r.stderr
    assert "MB to send, more than 200.0 MB" in r.stderr and "data.bin" in r.stderr and ".gitignore" in r.stderr
