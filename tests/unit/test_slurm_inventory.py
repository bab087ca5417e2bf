"""`slurm:` in the inventory (dtf.cluster.inventory) and the commands it becomes (dtf.providers.slurm.commands)."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dtf.cli import app
from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import Inventory, loads
from dtf.errors import InventoryError
from dtf.providers.slurm import commands as slurm

FULL = """\
cluster: hpc
defaults: {python: /opt/tf/bin/python3, workdir: ~/.dtf, user: alice}
slurm:
  login: {host: login.hpc.example.org, port: 2200}
  nodes: 3
  partition: gpu
  time: 1:30:00
  account: proj42
  qos: normal
  gpus_per_node: 4
  sbatch: [--constraint=a100, --exclusive]
  ps: 1
  workers: 2
  tf_port: 3000
"""


def parse(text: str) -> Inventory:
    return loads(textwrap.dedent(text), "inventory.yaml")


def errors(text: str) -> list[str]:
    with pytest.raises(InventoryError) as info:
        loads(textwrap.dedent(text), "inventory.yaml")
    return info.value.lines()


def test_a_full_slurm_section() -> None:
    inv = parse(FULL)
    assert inv.hosts == () and inv.slurm is not None
    s = inv.slurm
    assert (s.login.host, s.login.user, s.login.port, s.login.connection) == ("login.hpc.example.org", "alice", 2200, "ssh")
    assert (s.nodes, s.job, s.partition, s.account, s.qos, s.gpus_per_node) == (3, None, "gpu", "proj42", "normal", 4)
    assert s.time == "1:30:00"  # as written, though YAML 1.1 reads it as a number in base 60
    assert s.sbatch == ("--constraint=a100", "--exclusive") and s.submits
    assert (s.node.ps_ports, s.node.worker_ports, s.node.python, s.node.gpus) == ((3000,), (3001, 3002), "/opt/tf/bin/python3", (0, 1, 2, 3))


def test_the_nodes_become_hosts_in_slurms_order() -> None:
    inv = parse(FULL).with_nodes(("gpu7", "gpu3", "gpu9"))
    assert [h.host for h in inv.hosts] == ["gpu7", "gpu3", "gpu9"]
    assert (inv.num_ps, inv.num_workers) == (3, 6)
    assert all(h.connection == "slurm" and h.worker_ports == (3001, 3002) for h in inv.hosts)


def test_salloc_command() -> None:
    inv = parse(FULL)
    assert inv.slurm is not None
    assert slurm.salloc_argv(inv) == [
        "salloc", "--no-shell", "--job-name=dtf-hpc", "--nodes=3", "--ntasks-per-node=1",
        "--partition=gpu", "--time=1:30:00", "--account=proj42", "--qos=normal", "--gpus-per-node=4",
        "--constraint=a100", "--exclusive"]
    watch = slurm.watch_argv(inv, "77", "gpu7")
    assert watch[:8] == ["srun", "--quiet", "--jobid=77", "--overlap", "--nodes=1", "--ntasks=1",
                         "--nodelist=gpu7", "--job-name=dtf-hpc-lease"]
    assert watch[-3:] == ["sh", "-c", slurm.watch_script(inv)]


def test_the_lease_watch_cancels_the_job_when_the_lease_lapses(tmp_path: Path) -> None:
    """It cancels the job (scancel $SLURM_JOB_ID) when the lease on the first node lapses (also
    when the supervisors removed the files after it lapsed); it holds while the lease is fresh,
    before the tasks started, and when the files go while the lease was fresh (`dtf down` cancels
    the job once every node is clean)."""
    import json
    import os
    import subprocess
    import sys
    import time

    inv = parse(FULL.replace("~/.dtf", str(tmp_path)).replace("/opt/tf/bin/python3", sys.executable))
    script = slurm.watch_script(inv, poll=0.05)
    lease = tmp_path / "hpc" / "lease.json"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {bin_dir}/scancel.args\n')
    (bin_dir / "scancel").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sh", "-c", script], env=env)

    def holds(proc: subprocess.Popen[bytes], seconds: float = 0.5) -> bool:
        try:
            proc.wait(seconds)
            return False
        except subprocess.TimeoutExpired:
            return True

    lease.parent.mkdir()
    lease.write_text(json.dumps({"ttl": 1, "renewed": time.time() - 5}))
    os.utime(lease, (time.time() - 10, time.time() - 10))
    proc = start()
    try:
        assert holds(proc)  # an earlier job's lease, lapsed: not this job's
        lease.unlink()
        assert holds(proc)  # no cluster yet
        lease.write_text(json.dumps({"ttl": 60, "renewed": time.time()}))
        assert holds(proc)
        lease.unlink()  # `dtf down` removed the files: the lease was fresh
        assert holds(proc)
        lease.write_text(json.dumps({"ttl": 0, "renewed": 0}))
        assert holds(proc)  # ttl 0: never lapses
        lease.write_text(json.dumps({"ttl": 1, "renewed": time.time() - 5}))
        assert not holds(proc, 30) and proc.returncode == 0
        assert (bin_dir / "scancel.args").read_text() == "77\n"
        # The supervisors removed the files once it lapsed: the script saw the lease while it was
        # fresh, then never again. A fresh lease appears and goes until the script has seen one
        # (however slow this machine is to start Python): then it ends once that one lapses.
        lease.unlink()
        proc = start()
        deadline = time.monotonic() + 60
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the script never ended after a lease it saw lapsed"
            lease.write_text(json.dumps({"ttl": 1, "renewed": time.time()}))
            time.sleep(0.3)
            lease.unlink()
            holds(proc, 2)
        assert proc.returncode == 0
        assert (bin_dir / "scancel.args").read_text() == "77\n77\n"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("body", "expected"), [
    ("  login: l\n  workers: 1\n", "3:3: slurm: missing required key 'nodes' (or 'job': an allocation you made)"),
    ("  nodes: 1\n  workers: 1\n", "3:3: slurm: missing required key 'login'"),
    ("  login: l\n  nodes: 0\n  workers: 1\n", "4:3: slurm.nodes: expected a number of nodes 1..100000, got 0"),
    ("  login: l\n  nodes: 2\n", "2:1: slurm.workers: no worker task: each node needs workers: 1 or more"),
    ("  login: l\n  nodes: 2\n  time: soon\n  workers: 1\n",
     "5:3: slurm.time: expected a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS, e.g. '1:30:00'), got 'soon'"),
    ("  login: l\n  nodes: 2\n  partition: a;b\n  workers: 1\n",
     "5:3: slurm.partition: expected a partition name without quotes or shell characters such as ; $ ` ( ) < > |, got 'a;b'"),
    ("  login: l\n  nodes: 2\n  sbatch: [--time=5]\n  workers: 1\n",
     "5:3: slurm.sbatch: '--time=5' in the list: set it with slurm.time"),
    ("  login: l\n  nodes: 2\n  sbatch: [--job-name=x]\n  workers: 1\n",
     "5:3: slurm.sbatch: '--job-name=x' in the list: dtf sets it itself"),
    ("  login: l\n  nodes: 2\n  sbatch: [--wrap=x]\n  workers: 1\n",
     "5:3: slurm.sbatch: '--wrap=x' in the list: a batch script's option; dtf asks for the allocation "
     "with salloc, which takes the others"),
    ("  login: l\n  nodes: 2\n  sbatch: [constraint]\n  workers: 1\n",
     "5:3: slurm.sbatch: expected a list of sbatch options such as '--constraint=a100' or '--exclusive', got 'constraint' in the list"),
    ("  login: l\n  job: 12x\n  workers: 1\n",
     "4:3: slurm.job: expected a Slurm job id (a whole number, as squeue shows it), got '12x'"),
    ("  login: l\n  job: 12\n  partition: p\n  workers: 1\n",
     "5:3: slurm.partition: not with job: that allocation is made already (remove one of them)"),
    ("  login: {host: l, python: x}\n  nodes: 1\n  workers: 1\n", "3:20: slurm.login.python: unknown key"),
    ("  login: l\n  nodes: 1\n  workers: 1\n  packages: [pandas]\n",
     "6:3: slurm.packages: only for a managed environment (python: managed); the nodes' python is 'python3'"),
    ("  login: l\n  nodes: 1\n  host: x\n  workers: 1\n", "5:3: slurm.host: in slurm.login (the login host)"),
])
def test_mistakes_say_where(body: str, expected: str) -> None:
    assert errors("cluster: c\nslurm:\n" + body) == [f"inventory.yaml:{expected}"]


def test_hosts_and_slurm_together() -> None:
    assert errors("cluster: c\nhosts:\n  - {host: a, workers: 1}\nslurm: {login: l, nodes: 1, workers: 1}\n") == [
        "inventory.yaml:4:1: slurm: expected hosts or slurm, not both: slurm's nodes are the hosts"]


def test_neither_hosts_nor_slurm() -> None:
    assert errors("cluster: c\n") == ["inventory.yaml:1:1: missing required key 'hosts'"]


def test_host_only_defaults_are_refused() -> None:
    assert errors("cluster: c\ndefaults: {address: x}\nslurm: {login: l, nodes: 1, workers: 1}\n") == [
        "inventory.yaml:2:12: defaults.address: not with slurm: Slurm decides where tasks run"]


def test_dry_run_shows_the_salloc_command_and_the_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "home"))
    path = tmp_path / "inventory.yaml"
    path.write_text(FULL)
    r = CliRunner().invoke(app, ["up", "--dry-run", str(path)])
    assert r.exit_code == 0, r.output
    assert "through the login host (ssh -l alice -p 2200 login.hpc.example.org)" in r.output
    assert ("submit   salloc --no-shell --job-name=dtf-hpc --nodes=3 --ntasks-per-node=1 "
            "--partition=gpu --time=1:30:00 --account=proj42 --qos=normal --gpus-per-node=4 --constraint=a100 "
            "--exclusive\n") in r.output
    assert "a job step on its first node cancels it when the cluster's lease lapses there" in r.output
    assert "  node 1: ps:1 :3000, worker:2 :3001, worker:3 :3002" in r.output
    assert not (tmp_path / "home").exists()


def test_squeue_answers() -> None:
    assert slurm.parse_squeue("PENDING|Resources|||30:00\n") == slurm.JobState("PENDING", "Resources", "", "", "30:00")
    assert slurm.parse_squeue("RUNNING|None|h[1-2]|0:05|29:55\n").nodelist == "h[1-2]"
    assert slurm.parse_squeue("").gone
    assert slurm.parse_job_id("123;cluster\n") == "123"
    with pytest.raises(ValueError):
        slurm.parse_job_id("salloc: error: Job submit/allocate failed")


def test_a_plan_on_an_allocation_round_trips() -> None:
    from dtf.cluster.plan import Plan, make_plan

    inv = parse(FULL)
    assert inv.slurm is not None
    alloc = Allocation(job="77", submitted=True, login=inv.slurm.login, nodes=("n1", "n2", "n3"),
                             addresses=("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    plan = make_plan(inv.with_nodes(alloc.nodes), allocation=alloc)
    assert plan.cluster_spec()["worker"][2:4] == ["10.0.0.2:3001", "10.0.0.2:3002"]
    assert Plan.from_dict(plan.to_dict()) == plan
    start = plan.hosts[1].check_start_argv(None, "2.21.0", keep=True)
    assert start[2] == "check-start" and "--keep" in start and "--fresh" in start
    assert "--keep" not in plan.hosts[1].check_start_argv(None, "2.21.0")
    assert slurm.step_argv("77", "n2", ["x"], name="dtf-hpc-ps:1+worker:1") == [
        "srun", "--quiet", "--jobid=77", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2",
        "--job-name=dtf-hpc-ps:1+worker:1", "--kill-on-bad-exit=0", "x"]


GPU = """\
cluster: g
slurm: {login: login, nodes: 2, workers: 2, sbatch: [--exclusive, "--gres=gpu:a100:4,tmpfs:10G"]}
"""


def test_a_gres_of_gpus_gives_the_nodes_their_gpus_and_goes_to_the_copies_step() -> None:
    inv = parse(GPU)
    assert inv.slurm is not None and inv.slurm.node.gpus == (0, 1, 2, 3)
    assert slurm.gpu_options(slurm.salloc_argv(inv)) == ["--gres=gpu:a100:4,tmpfs:10G"]
    assert parse(GPU.replace("gpu:a100:4", "gpu")).slurm.node.gpus == (0,)  # type: ignore[union-attr]
    assert parse(GPU.replace("gpu:a100:4", "tmpfs:1G")).slurm.node.gpus is None  # type: ignore[union-attr]
    assert slurm.gpu_options(slurm.salloc_argv(parse(FULL))) == ["--gpus-per-node=4"]
    assert errors(GPU.replace("workers: 2,", "workers: 2, gpus_per_node: 4,")) == [
        "inventory.yaml:2:63: slurm.sbatch: a --gres of GPUs and slurm.gpus_per_node: one GPU request per node "
        "(remove one of them)"]


def test_the_copies_step_asks_for_the_allocations_gpus() -> None:
    argv = slurm.program_step_argv("77", ["n1", "n2"], 2, "g", ["launcher"], gpus=["--gpus-per-node=4"])
    assert argv[:11] == ["srun", "--quiet", "--jobid=77", "--overlap", "--overcommit", "--nodes=2", "--ntasks=4",
                         "--ntasks-per-node=2", "--nodelist=n1,n2", "--distribution=block", "--gpus-per-node=4"]
    assert "--gpus-per-node=4" not in slurm.program_step_argv("77", ["n1"], 1, "g", ["launcher"])


def slurm_plan(text: str, nodes: tuple[str, ...] = ("n1", "n2")):  # type: ignore[no-untyped-def]
    from dtf.cluster.plan import make_plan

    inv = parse(text)
    assert inv.slurm is not None
    alloc = Allocation(job="77", submitted=True, login=inv.slurm.login, nodes=nodes,
                             addresses=tuple(f"10.0.0.{i + 1}" for i in range(len(nodes))), request=slurm.request(inv))
    return make_plan(inv.with_nodes(alloc.nodes), allocation=alloc)


@pytest.mark.parametrize("gpus,workers,note", [
    (4, 2, None), (8, 4, None), (2, 2, None), (1, 1, None),
    (3, 2, "3 GPUs per node do not split evenly among 2 workers per node"),
    (1, 2, "1 GPU(s) per node for 2 workers per node"),
])
def test_each_copys_gpus_agree_with_slurm_cluster_resolver(gpus: int, workers: int, note: str | None) -> None:
    """Each copy sees dtf's share of its node's GPUs (a program reading TF_CONFIG uses it), and
    SlurmClusterResolver, counting the node's GPUs ($DTF_NODE_GPUS), gives its k-th task on a node
    block k of gpus // workers ids: the same ids (or dtf says why not)."""
    from dtf.cluster import gpus as dtf_gpus
    from dtf.collective import run as collective

    plan = slurm_plan(f"cluster: g\nslurm: {{login: login, nodes: 2, workers: {workers}, gpus_per_node: {gpus}}}\n")
    notes = collective.check_plan(plan)
    assert (notes[0] if notes else None) == (None if note is None else notes[0]) and (note is None or note in notes[0])
    for t in collective.workers(plan):
        env = dict(a.split("=", 1) for a in collective.copy_argv(plan, t, "p.py", [], 1) if "=" in a and not a.startswith("TF_CONFIG"))
        assert env["DTF_NODE_GPUS"] == str(gpus)
        k = plan.host_of(t).spec.worker_ports.index(t.port)  # the task's place on its node: SLURM_LOCALID
        per_task = gpus // workers
        resolver = ",".join(str(i) for i in range(k * per_task, (k + 1) * per_task))  # what auto_set_gpu sets
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, dtf_gpus.shares(range(gpus), workers)[k]))
        if note is None:
            assert env["CUDA_VISIBLE_DEVICES"] == resolver


def test_no_gpus_no_gpu_variables_on_slurm() -> None:
    from dtf.collective import run as collective

    plan = slurm_plan("cluster: g\nslurm: {login: login, nodes: 2, workers: 1}\n")
    argv = collective.copy_argv(plan, collective.workers(plan)[0], "p.py", [], 1)
    assert not [a for a in argv if a.startswith(("CUDA_VISIBLE_DEVICES=", "DTF_NODE_GPUS="))]
    assert collective.check_plan(plan) == []


def test_the_hook_makes_slurm_cluster_resolver_count_the_nodes_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """dtf.program.hooks.collective on a stand-in for TensorFlow's slurm_cluster_resolver module
    (the unit tests import no TensorFlow): its get_num_gpus, which the resolver calls for a
    missing gpus_per_node, answers the node's count."""
    import sys
    import types

    from dtf.program.hooks import collective as hook

    fake = types.ModuleType(hook.SLURM_RESOLVER)
    fake.get_num_gpus = lambda: 2  # type: ignore[attr-defined]  # len(CUDA_VISIBLE_DEVICES): the copy's share
    monkeypatch.setitem(sys.modules, hook.SLURM_RESOLVER, fake)
    monkeypatch.setenv("DTF_NODE_GPUS", "4")
    monkeypatch.delenv(hook.JOINED_ENV, raising=False)
    hook.install()
    assert fake.get_num_gpus() == 4  # type: ignore[attr-defined]


def fake_slurm(bin_dir: Path, states: list[str], salloc: str = "42") -> None:
    """Stand-ins for salloc, squeue and scontrol on PATH: salloc says `salloc` and stays a moment
    (as while its job pends); squeue answers `states` one per call (then the last again); 'gone'
    is squeue's answer for a job it no longer knows."""
    import shutil

    shutil.rmtree(bin_dir, ignore_errors=True)
    bin_dir.mkdir()
    (bin_dir / "states").write_text("\n".join(states) + "\n")
    scripts = {
        "salloc": f'echo "$@" > "{bin_dir}/salloc.args"; echo "{salloc}" >&2; sleep 0.3',
        "squeue": (f'n=$(cat "{bin_dir}/n" 2>/dev/null || echo 0); echo $((n + 1)) > "{bin_dir}/n"; '
                   f'line=$(sed -n "$((n + 1))p" "{bin_dir}/states"); [ -n "$line" ] || line=$(tail -1 "{bin_dir}/states"); '
                   'if [ "$line" = gone ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi; '
                   'echo "$line"'),
        "scancel": f'echo "$@" > "{bin_dir}/scancel.args"',
        "srun": f'echo "$@" > "{bin_dir}/srun.args.tmp"; mv "{bin_dir}/srun.args.tmp" "{bin_dir}/srun.args"',
        # Slurm's order of the job's nodes, as `scontrol show node` walks them (not sorted)
        "scontrol": ('if [ "$1 $2 $3" = "--oneliner show node" ]; then '
                     'echo "NodeName=n2 NodeAddr=10.0.0.2 State=ALLOCATED"; '
                     'echo "NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1 State=ALLOCATED"; '
                     'else echo "scontrol: unexpected $*" >&2; exit 1; fi'),
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)


def run_wait(tmp_path: Path, argv: list[str], states: list[str], salloc: str = "42"):  # type: ignore[no-untyped-def]
    import os
    import subprocess

    fake_slurm(tmp_path / "bin", states, salloc)
    return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})


def test_one_command_submits_waits_and_names_the_nodes(tmp_path: Path) -> None:
    """`up`'s allocation in one command on the login host: salloc (left waiting in the
    background, its job id read from what it says first), squeue until the job runs (0.1 s apart
    there, not a round trip each), then its nodes in Slurm's order and addresses."""
    running = "RUNNING|None|n[1-2]|0:01|59:59"
    r = run_wait(tmp_path, slurm.wait_argv(submit=["salloc", "--no-shell", "--constraint=a b"]),
                 ["PENDING|Resources|||", "CONFIGURING|None|n[1-2]|0:00|1:00:00", running],
                 salloc="salloc: Pending job allocation 42\nsalloc: job 42 queued and waiting for resources")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bin" / "salloc.args").read_text() == "--no-shell --constraint=a b\n"
    w = slurm.parse_wait(r.stdout)
    assert (w.job, w.state.state, w.nodes, w.addresses) == ("42", "RUNNING", ("n2", "n1"),
                                                             {"n1": "10.0.0.1", "n2": "10.0.0.2"})


def test_a_look_at_a_pending_job_ends_after_its_time(tmp_path: Path) -> None:
    """A look lasts its seconds by the login host's clock (plus one squeue), whatever squeue costs."""
    r = run_wait(tmp_path, slurm.wait_argv("42", seconds=0.3, pause=0.05), ["PENDING|Priority|||"])
    assert r.returncode == 0, r.stderr
    w = slurm.parse_wait(r.stdout)
    assert (w.job, w.state.state, w.state.reason, w.nodes) == (None, "PENDING", "Priority", ())
    assert int((tmp_path / "bin" / "n").read_text()) >= 2  # squeue again within the look
    r = run_wait(tmp_path, slurm.wait_argv("42", seconds=0), ["PENDING|Priority|||"])
    assert slurm.parse_wait(r.stdout).state.state == "PENDING"
    assert (tmp_path / "bin" / "n").read_text().strip() == "1"  # no time: one squeue


def test_a_job_squeue_forgot_is_gone_and_a_failed_salloc_says_why(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r = run_wait(tmp_path, slurm.wait_argv("42"), ["gone"])
    assert r.returncode == 0 and slurm.parse_wait(r.stdout).state.gone, (r.stdout, r.stderr)
    r = run_wait(tmp_path, slurm.wait_argv("42"), ["COMPLETING|None|n1|0:10|0:00"])
    assert slurm.parse_wait(r.stdout).state.state == "COMPLETING"
    r = run_wait(tmp_path, slurm.wait_argv("42"), ["RUNNING|None|n[1-2]|0:01|59:59"],
                 salloc="salloc: Granted job allocation 42")
    assert slurm.parse_wait(r.stdout).state.state == "RUNNING"
    # a granted allocation: salloc says so and exits (--no-shell)
    r = run_wait(tmp_path, slurm.wait_argv(submit=["salloc"]), ["RUNNING|None|n[1-2]|0:01|59:59"],
                 salloc="salloc: Granted job allocation 7")
    assert r.returncode == 0 and slurm.parse_wait(r.stdout).job == "7", (r.stdout, r.stderr)
    # salloc ends without a job: its last words, at once (not at the deadline for its id, here
    # longer than run_wait waits)
    monkeypatch.setattr(slurm, "ID_SECONDS", 3600)
    r = run_wait(tmp_path, slurm.wait_argv(submit=["sh", "-c", "echo 'salloc: error: invalid partition' >&2; "
                                                               "echo 'salloc: error: Job submit/allocate failed' >&2; "
                                                               "exit 1"]), ["gone"])
    assert (r.returncode, r.stderr.strip()) == (1, "salloc: error: Job submit/allocate failed")
    assert slurm.parse_wait(r.stdout).job is None


def test_the_look_that_finds_the_job_running_starts_the_lease_watch_on_its_first_node(tmp_path: Path) -> None:
    """`up`'s lease watch comes with the answer that the job runs, not in a command of its own: a
    job step of that job on its first node (in Slurm's order), started detached; none while the job
    pends, none without `then` (the user's own job)."""
    inv = loads("cluster: c\nslurm: {login: l, nodes: 2, workers: 1}\n")
    srun_args = tmp_path / "bin" / "srun.args"
    r = run_wait(tmp_path, slurm.wait_argv("42", seconds=0, then=slurm.watch_command(inv)), ["PENDING|Priority|||"])
    assert slurm.parse_wait(r.stdout).state.state == "PENDING"
    time.sleep(0.3)
    assert not srun_args.exists()
    r = run_wait(tmp_path, slurm.wait_argv(submit=["salloc"], then=slurm.watch_command(inv)),
                 ["RUNNING|None|n[1-2]|0:01|59:59"], salloc="salloc: Granted job allocation 7")
    assert r.returncode == 0, r.stderr
    assert slurm.parse_wait(r.stdout).nodes == ("n2", "n1")
    deadline = time.monotonic() + 10  # (detached: it may come after the answer)
    while not srun_args.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    args = srun_args.read_text().split()
    assert args[:7] == ["--quiet", "--jobid=7", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2",
                        "--job-name=dtf-c-lease"]
    assert args[8:10] == ["sh", "-c"]
    r = run_wait(tmp_path, slurm.wait_argv("42"), ["RUNNING|None|n[1-2]|0:01|59:59"])
    time.sleep(0.3)
    assert slurm.parse_wait(r.stdout).state.state == "RUNNING" and not srun_args.exists()


def test_a_laptop_gone_before_the_answer_leaves_no_job(tmp_path: Path) -> None:
    """An `up` interrupted (Ctrl-C) while its first command waits for salloc's job id closes that
    SSH session: the command cannot write its answer, and cancels the job it asked for."""
    import os
    import subprocess

    fake_slurm(tmp_path / "bin", ["PENDING|Resources|||"], "salloc: Pending job allocation 42")
    proc = subprocess.Popen(slurm.wait_argv(submit=["salloc", "--no-shell"]), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert proc.stdout is not None
    proc.stdout.close()  # the laptop's end of the session, gone before salloc said the job's id
    assert proc.wait(timeout=30) == 1
    assert (tmp_path / "bin" / "scancel.args").read_text() == "42\n"
    # a look at a job it did not ask for never cancels it
    proc = subprocess.Popen(slurm.wait_argv("43", seconds=0), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert proc.stdout is not None
    proc.stdout.close()
    proc.wait(timeout=30)
    assert (tmp_path / "bin" / "scancel.args").read_text() == "42\n"


def test_cancel_waits_on_the_login_host_until_the_queue_forgets_the_job(tmp_path: Path) -> None:
    """`down`'s cancel in one command: scancel, then squeue 0.05 s apart until the job is not
    listed (nothing printed, or squeue no longer knows it); a squeue error is looked past; still
    listed at the deadline: exit 3 with squeue's last answer."""
    r = run_wait(tmp_path, slurm.cancel_argv("42", 5), ["COMPLETING", "COMPLETING", "Socket timed out", ""])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bin" / "scancel.args").read_text() == "42\n"
    assert (tmp_path / "bin" / "n").read_text().strip() == "4"
    r = run_wait(tmp_path, slurm.cancel_argv("42", 5), ["CANCELLED", "gone"])
    assert r.returncode == 0, r.stderr
    r = run_wait(tmp_path, slurm.cancel_argv("42", 0.2, pause=0.05), ["COMPLETING"])
    assert (r.returncode, r.stderr.strip()) == (3, "COMPLETING")
    assert int((tmp_path / "bin" / "n").read_text()) == 4
