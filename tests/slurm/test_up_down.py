"""`dtf up` / `dtf down` on the Slurm lab, with fake servers (DTF_SERVER=fake): the allocation,
tasks as job steps on nodes the laptop cannot reach, and a queue left empty."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import REPO, as_in_a_terminal, assert_one_line_error, dtf, fake_server
from sites import listener
from slurmlab import STUCK, SlurmLab

FAKE = {"DTF_SERVER": "fake"}


def workdir(lab: SlurmLab) -> str:
    """On each node's own disk (a tmpfs of its slurmd's: nothing shared with the laptop), named
    for the lab (a process of another lab's is never counted as this one's)."""
    return f"/srv/dtf-{lab.name}"


def inventory(lab: SlurmLab, path: Path, cluster: str = "sl", **slurm: Any) -> Path:
    doc = {"cluster": cluster, "ssh_config": str(lab.ssh_config),
           "defaults": {"identity_file": str(lab.key), "python": sys.executable, "workdir": workdir(lab)},
           "slurm": {"login": lab.login.name, **({"nodes": 2} if "job" not in slurm else {}),
                     "ps": 1, "workers": 1, **slurm}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def ours(lab: SlurmLab, job: str) -> list[str]:
    return [line for line in lab.queue() if line.split()[0] == job]


def node_processes(lab: SlurmLab) -> list[str]:
    """dtf's processes on the compute nodes (their command lines name the workdir)."""
    return [cmd for _, cmd in lab.processes(workdir(lab))]


def left_behind(lab: SlurmLab, timeout: float = 10) -> list[str]:
    """dtf's processes on the nodes (and its srun clients on the login host) once they are gone, or
    at the deadline: an srun client's helper process exits a moment after the command's answer."""
    deadline = time.monotonic() + timeout
    while (found := node_processes(lab)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def ancestors(pid: int) -> list[str]:
    """The names of a process's parents, up to init."""
    names = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        names.append(comm(pid))
    return names


def steps(lab: SlurmLab, job: str) -> list[str]:
    r = lab.slurm(["squeue", "-h", "-s", f"--jobs={job}", "-o", "%i %j %N"])
    return r.stdout.split("\n")[:-1]


def job_of(output: str) -> str:
    line = next(x for x in output.splitlines() if x.startswith("job ") and "submitted" in x)
    return line.split()[1]


def dtf_steps(lab: SlurmLab, job: str, prefix: str, count: int) -> list[str]:
    """The job's steps whose name starts with `prefix` (squeue's lines, sorted), once there are
    `count` of them (or 30 s on): the lease watch's starts WATCH_DELAY after the job runs, and
    an `up` can be done before it is."""
    deadline = time.monotonic() + 30
    while len(found := sorted(line for line in steps(lab, job) if prefix in line)) < count \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def login_commands(lab: SlurmLab) -> int:
    """Commands the login host's sshd ran so far (sessions over the masters; LogLevel VERBOSE)."""
    return (lab.root / lab.login.name / "sshd.log").read_text(errors="replace").count("Starting session: command")


def test_up_status_down(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml")
    home = tmp_path / "home"
    before = login_commands(slurm_lab)
    t0 = time.monotonic()
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    up_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    # One command on the login host for salloc, the wait and the lease watch, then one per node for
    # its start (a job step that stays); this machine then only checks it reaches the tasks through
    # the login host's master (forwarded connections, no command).
    assert login_commands(slurm_lab) == before + 1 + len(slurm_lab.computes)
    assert ours(slurm_lab, job) == [f"{job} RUNNING"]
    # one job step per node, named for its tasks, and the lease watch on the first node
    names = sorted(line.split()[1:] for line in dtf_steps(slurm_lab, job, "dtf-sl-", 3))
    assert names == [["dtf-sl-lease", "h1"], ["dtf-sl-ps:0+worker:0", "h1"], ["dtf-sl-ps:1+worker:1", "h2"]], \
        steps(slurm_lab, job)
    # the tasks serve on the compute nodes, at their own addresses
    assert all(h.address in r.stdout for h in slurm_lab.computes), r.stdout
    r = dtf("status", home=home, env=FAKE, timeout=60)
    assert r.returncode == 0 and r.stdout.count(" alive ") == 4, r.stdout + r.stderr
    assert f"slurm job {job} (submitted by dtf): RUNNING, time used " in r.stdout
    r = dtf("status", "--json", home=home, env=FAKE, timeout=60)
    slurm = json.loads(r.stdout)["slurm"]
    assert (slurm["job"], slurm["state"], slurm["nodes"]) == (job, "RUNNING", ["h1", "h2"])
    r = dtf("logs", "worker:1", home=home, env=FAKE, timeout=60)  # from h2's own disk, through a job step
    assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    # `dtf top`: each node's samples stream from a job step; the step ends with the view.
    before = sorted(steps(slurm_lab, job))
    r = dtf("top", "--json", home=home, env=FAKE, timeout=90)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    top = json.loads(r.stdout)
    assert top["summary"]["states"] == {"alive": 4}, top
    assert all(row["rss"] > 0 and row["cpu"] is not None and row["error"] is None for row in top["tasks"]), top
    deadline = time.monotonic() + 30
    while (now := sorted(steps(slurm_lab, job))) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert now == before, (before, now)  # no step of `top` is left
    # `up` again: the recorded allocation still runs, every task serves: nothing submitted, nothing changed
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "submitted" not in r.stdout and ours(slurm_lab, job) == [f"{job} RUNNING"] and len(slurm_lab.queue()) == 1
    t0 = time.monotonic()
    r = dtf("down", home=home, env=FAKE, timeout=120)
    down_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    left = next(line for line in r.stdout.splitlines() if "the queue no longer lists it" in line)
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []
    print(f"\nslurm lab, fake servers, 2 nodes x (1 ps, 1 worker): up {up_s:.1f}s, down {down_s:.1f}s; {left}")


def test_a_site_that_drops_the_laptops_packets_to_the_nodes(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """The compute nodes' network gives the laptop no answer at all (a drop, not the lab's usual
    reset): `up` reaches the tasks through the login host (network auto: ssh) without waiting the
    direct probes out (dtf.providers.route.SLURM_GRACE), and `down` leaves nothing."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="dropped")
    home = tmp_path / "home"
    slurm_lab.close_to_laptop(drop=True)
    try:
        assert not slurm_lab.connects(None, slurm_lab.computes[0].address, 2222)
        r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "network: ssh; the TF ports are closed to this machine" in r.stdout, r.stdout
        job = job_of(r.stdout)
        r = dtf("status", home=home, env=FAKE, timeout=60)
        assert r.returncode == 0 and r.stdout.count(" alive ") == 4, r.stdout + r.stderr
        r = dtf("down", home=home, env=FAKE, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert ours(slurm_lab, job) == [] and left_behind(slurm_lab) == []
    finally:
        slurm_lab.close_to_laptop()


def test_an_up_that_fails_cancels_the_job_it_submitted(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="bad", python="/nonexistent/python3")
    r = dtf("up", str(inv), home=tmp_path / "home", env=FAKE, timeout=120)
    assert_one_line_error(r, 4, "h1: python missing", "h2: python missing")
    job = job_of(r.stdout)
    assert f"job {job} cancelled; the queue no longer lists it" in r.stdout
    assert ours(slurm_lab, job) == []


def test_ctrl_c_while_pending_cancels_the_job(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="pend", partition=STUCK, nodes=1)
    env = {**os.environ, "DTF_HOME": str(tmp_path / "home"), "COLUMNS": "200", **FAKE}
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "up", str(inv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, preexec_fn=as_in_a_terminal)
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if "PENDING" in line or not line:
            break
    assert "PENDING" in seen[-1] and "waited" in seen[-1], seen
    job = job_of("".join(seen))
    assert ours(slurm_lab, job) == [f"{job} PENDING"]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert f"job {job} cancelled; the queue no longer lists it" in out, out
    assert ours(slurm_lab, job) == []


def test_ctrl_c_before_the_job_id_came_back_leaves_no_job(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """Ctrl-C while `up`'s first command on the login host still runs (salloc asked, the job in
    the queue, its id not yet back on the laptop): that command, unable to answer, cancels the job.
    (Should this machine be so slow that the answer came back first, dtf cancels it itself.)"""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="early", partition=STUCK, nodes=1)
    env = {**os.environ, "DTF_HOME": str(tmp_path / "home"), "COLUMNS": "200", **FAKE}
    before = set(slurm_lab.queue())
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "up", str(inv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 60
    while not (new := set(slurm_lab.queue()) - before) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert new, "no job was asked for"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    job = next(iter(new)).split()[0]
    deadline = time.monotonic() + 30
    while ours(slurm_lab, job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours(slurm_lab, job) == [], out


def test_ctrl_c_while_the_nodes_start_leaves_no_job_and_nothing_on_them(
        slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """Ctrl-C while the nodes' steps start (servers that serve only once the test lets them, right
    after the Ctrl-C: whatever this machine's speed, the Ctrl-C comes first): `up` has said the
    job and its nodes meanwhile; once the nodes' starts answer (as an SSH host's start, a step is
    not cut short) it rolls back and exits 130, cancelling the job, which ends the steps: nothing
    is left in the queue or on a node."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="held")
    release = tmp_path / "release"
    env = {**os.environ, "DTF_HOME": str(tmp_path / "home"), "COLUMNS": "200",
           "DTF_SERVER": f"fake:ready_file={release}"}
    before = {line.split()[0] for line in slurm_lab.queue()}
    proc = subprocess.Popen([sys.executable, "-m", "dtf.cli", "up", str(inv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 90
        while (len([p for p in slurm_lab.processes(workdir(slurm_lab)) if fake_server(*p)]) < 4 and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        new = {line.split()[0] for line in slurm_lab.queue()} - before
        assert len(new) == 1, slurm_lab.queue()
        assert proc.stdout is not None
        seen = [proc.stdout.readline() for _ in range(2)]  # (said before the nodes' steps began)
        assert seen[0].startswith(f"job {next(iter(new))} submitted: dtf-held, 2 node(s)"), seen
        assert " runs on h[1-2] (waited 0s)" in seen[1], seen
        proc.send_signal(signal.SIGINT)
    finally:
        release.write_text("")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    job = new.pop()
    deadline = time.monotonic() + 30
    while ours(slurm_lab, job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours(slurm_lab, job) == [], out
    assert left_behind(slurm_lab, timeout=30) == []


def masters(prefix: str) -> list[str]:
    """The ssh masters of one cluster on this machine (their ControlPath starts with `prefix`)."""
    r = subprocess.run(["pgrep", "-af", f"ControlPath={prefix}"], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if "pgrep" not in line]


def test_ctrl_c_while_up_opens_the_login_master_leaves_no_master_nor_job(slurm_lab: SlurmLab, tmp_path: Path
                                                                          ) -> None:
    """A Ctrl-C as soon as `up`'s ssh to the login host runs, in the handshake or just after it,
    leaves no master behind, nor a job. (A partition with no free node: the `up` cannot end
    before the Ctrl-C, however fast.)"""
    from dtf.hosts.control import cluster_prefix

    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="early2", partition=STUCK, nodes=1)
    home = tmp_path / "home"
    env = {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", **FAKE}
    prefix = cluster_prefix(home, "early2")
    before = {line.split()[0] for line in slurm_lab.queue()}
    command = [sys.executable, "-m", "dtf", "up", str(inv)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 60
    while not masters(prefix) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 15
    while masters(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert masters(prefix) == []
    for job in {line.split()[0] for line in slurm_lab.queue()} - before:
        deadline = time.monotonic() + 30
        while ours(slurm_lab, job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours(slurm_lab, job) == [], out


def test_a_deadline_while_pending_cancels_the_job(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="late", partition=STUCK, nodes=1)
    r = dtf("up", "--slurm-wait", "3", str(inv), home=tmp_path / "home", env=FAKE, timeout=60)
    assert_one_line_error(r, 4, "still PENDING after 3s", "cancelled")
    job = job_of(r.stdout)
    assert ours(slurm_lab, job) == []
    assert not (tmp_path / "home" / "state" / "late.json").exists()


def test_an_existing_allocation_is_used_and_left_running(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    r = slurm_lab.slurm(["sbatch", "--parsable", "-N2", "--output=/dev/null", "--wrap", "exec sleep infinity"])
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    try:
        inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="mine", job=int(job))
        home = tmp_path / "home"
        r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        assert len([s for s in steps(slurm_lab, job) if "dtf-mine-" in s]) == 2  # a step per node
        r = dtf("down", home=home, env=FAKE, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"job {job} is yours" in r.stdout
        assert ours(slurm_lab, job) == [f"{job} RUNNING"]
        assert not [s for s in steps(slurm_lab, job) if "dtf-mine-" in s]
        assert left_behind(slurm_lab) == []
    finally:
        slurm_lab.slurm(["scancel", job])


def test_a_node_that_fails_its_check_starts_no_task_and_leaves_no_step(slurm_lab: SlurmLab,
                                                                        tmp_path: Path) -> None:
    """A node whose port is busy fails `up` in one line, no task starts there, the other node is
    rolled back, and no step of dtf's is left (in an allocation of the user's, which `up` does not
    cancel)."""
    r = slurm_lab.slurm(["sbatch", "--parsable", "-N2", "--output=/dev/null", "--wrap", "exec sleep infinity"])
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    holder = listener(slurm_lab, "h1", 2222)
    try:
        inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="busy", job=int(job))
        r = dtf("up", str(inv), home=tmp_path / "home", env=FAKE, timeout=180)
        assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", "h1: port busy: 2222 (ps:0)")
        deadline = time.monotonic() + 30
        while [s for s in steps(slurm_lab, job) if "dtf-busy-" in s] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [s for s in steps(slurm_lab, job) if "dtf-busy-" in s]
        assert left_behind(slurm_lab) == []
        assert ours(slurm_lab, job) == [f"{job} RUNNING"]
    finally:
        holder.kill()
        holder.wait()
        slurm_lab.slurm(["scancel", job])


def test_the_tasks_end_with_the_job(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """Every task runs inside the allocation: cancelling the job by hand ends them all (Slurm
    accounts for them, and nothing of dtf's outlives the job on the nodes)."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="ends")
    home = tmp_path / "home"
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    # each node's launcher stays in its step (a slurmstepd's child), its supervisors and servers
    # below it: Slurm accounts for every one of them. The lease watch starts WATCH_DELAY after the
    # job runs: an `up` can be done before it is (waited for, not raced).
    def ours_there() -> list[tuple[int, str]]:
        return [(pid, c) for pid, c in slurm_lab.processes(workdir(slurm_lab)) if c.startswith(f"{sys.executable} ")]

    deadline = time.monotonic() + 30
    while len(found := ours_there()) < 11 and time.monotonic() < deadline:
        time.sleep(0.1)
    names = sorted(comm(pid) for pid, _ in found)
    # 4 servers (each forked from its supervisor: dtf_server.supervisor.fork_server), the lease watch
    assert names == ["dtf ps:0", "dtf ps:1", "dtf step", "dtf step", "dtf worker:0", "dtf worker:1",
                     "fake ps:0", "fake ps:1", "fake worker:0", "fake worker:1", "python"], found
    outside = [(pid, c) for pid, c in found if "slurmstepd" not in ancestors(pid)]
    assert outside == [], outside
    slurm_lab.slurm(["scancel", job])
    assert left_behind(slurm_lab, timeout=30) == []
    deadline = time.monotonic() + 30
    while ours(slurm_lab, job) and time.monotonic() < deadline:  # COMPLETING a moment longer
        time.sleep(0.2)
    assert ours(slurm_lab, job) == []
    r = dtf("down", home=home, env=FAKE, timeout=120)  # the job is gone already: down says so, and forgets it
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"job {job} is no longer in the queue: its tasks ended with it" in r.stdout
    assert not (home / "state" / "ends.json").exists()


def test_the_lease_lapsing_ends_the_job(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    """No dtf command uses the cluster for its --ttl: its tasks stop themselves, and the lease
    watch, seeing the lease lapse on the first node, cancels the job (the laptop is gone: no
    `dtf down`)."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="lapse")
    home = tmp_path / "home"
    r = dtf("up", "--ttl", "6s", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    deadline = time.monotonic() + 60
    while ours(slurm_lab, job) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ours(slurm_lab, job) == []
    assert left_behind(slurm_lab) == []
    # `up` again (the laptop is back): a new allocation, the cluster anew
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"job {job} of cluster lapse is no longer in the queue" in r.stdout
    again = job_of(r.stdout)
    assert again != job and ours(slurm_lab, again) == [f"{again} RUNNING"]
    r = dtf("down", home=home, env=FAKE, timeout=60)
    assert r.returncode == 0 and ours(slurm_lab, again) == [], r.stdout + r.stderr
    assert left_behind(slurm_lab) == []


def test_another_allocation_is_refused_and_replace_starts_anew(slurm_lab: SlurmLab, tmp_path: Path) -> None:
    home = tmp_path / "home"
    r = dtf("up", str(inventory(slurm_lab, tmp_path / "two.yaml", cluster="re")), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    first = job_of(r.stdout)
    one = inventory(slurm_lab, tmp_path / "one.yaml", cluster="re", nodes=1)
    r = dtf("up", str(one), home=home, env=FAKE, timeout=120)
    assert_one_line_error(r, 8, f"slurm: job {first} was made by salloc --no-shell --job-name=dtf-re --nodes=2",
                          "slurm: this inventory asks for salloc --no-shell --job-name=dtf-re --nodes=1")
    assert ours(slurm_lab, first) == [f"{first} RUNNING"]
    r = dtf("up", "--replace", str(one), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    second = job_of(r.stdout)
    assert ours(slurm_lab, first) == [] and ours(slurm_lab, second) == [f"{second} RUNNING"]
    r = dtf("status", home=home, env=FAKE, timeout=60)
    assert r.stdout.count(" alive ") == 2, r.stdout
    r = dtf("down", home=home, env=FAKE, timeout=120)
    assert r.returncode == 0 and ours(slurm_lab, second) == [], r.stdout + r.stderr
    assert left_behind(slurm_lab) == []


@pytest.mark.parametrize("firewall", ["members", "auto (the default)"])
def test_the_firewall_lets_the_login_host_in(slurm_lab: SlurmLab, tmp_path: Path, firewall: str) -> None:
    """`firewall: members`, and the default where the node lets dtf set rules (the lab's jobs run
    as root): the nodes' TF ports open to the cluster's nodes and to the login host (every
    connection from the laptop comes through it), closed to the rest. The rules are the first step
    of each node's one job step (the launcher's `check-start --keep`)."""
    inv = inventory(slurm_lab, tmp_path / "inv.yaml", cluster="fw")
    if firewall == "members":
        doc = yaml.safe_load(inv.read_text())
        inv.write_text(yaml.safe_dump({**doc, "firewall": "members"}, sort_keys=False))
    home = tmp_path / "home"
    tables = slurm_lab.tables(slurm_lab.computes[0])  # the lab's own (it blocks the laptop)
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    job = job_of(r.stdout)
    names = sorted(line.split()[1] for line in dtf_steps(slurm_lab, job, "dtf-fw-", 3))
    assert names == ["dtf-fw-lease", "dtf-fw-ps:0+worker:0", "dtf-fw-ps:1+worker:1"], steps(slurm_lab, job)
    r = dtf("status", home=home, env=FAKE, timeout=60)
    assert r.returncode == 0 and r.stdout.count(" alive ") == 4, r.stdout + r.stderr
    h1, h2 = slurm_lab.computes
    assert len(slurm_lab.tables(h1)) == len(tables) + 1, slurm_lab.tables(h1)  # dtf's, beside the lab's own
    assert slurm_lab.connects(slurm_lab.login, h1.address, 2222)  # the login host
    assert slurm_lab.connects(h2, h1.address, 2222)  # a member
    r = dtf("down", home=home, env=FAKE, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert left_behind(slurm_lab) == []
    assert ours(slurm_lab, job) == []
    assert slurm_lab.tables(h1) == tables and slurm_lab.tables(h2) == tables
