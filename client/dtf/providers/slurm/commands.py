"""The Slurm commands dtf runs on a cluster's login host, as argv lists, and how it reads their
answers. Pure: no I/O (dtf.providers.slurm.allocation runs them) but reading the programs some of them run
(dtf.hosts.programs).

What dtf asks for is an allocation that holds its nodes and runs nothing of its own (`salloc
--no-shell`: Slurm grants it at once where the nodes are free, where a batch job waits for the
scheduler's next pass); every task then runs as a job step of it (`srun --jobid=ID --overlap -N1
-n1 -w NODE ...`), so Slurm accounts for the tasks and ends them with the job, and one more step
on its first node watches the cluster's lease (`watch_argv`).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from dtf.cluster.inventory import Inventory
from dtf.hosts.programs import script

# The lease watch of the allocation dtf submits: a job step on its first node that cancels the job
# once the cluster's lease there lapsed: no dtf command used the cluster for its ttl (`dtf up
# --ttl`: the laptop is gone), so an abandoned cluster gives its nodes back. The supervisors remove
# the cluster's files once the lease lapsed, so files gone after a lease that had lapsed are a lapse
# too; files gone while the lease was fresh are `dtf down` at work, which cancels the job itself
# once every node is clean (ending it sooner would cut the other nodes' clean). The program:
# scripts/lease_watch.py.
HOLD_POLL = 2.0  # seconds


def script_text(name: str) -> str:
    """A program of this package's scripts/ folder, as the text a command carries."""
    return script(name, "dtf.providers.slurm")


def quote_arg(arg: str) -> str:
    """As dtf.hosts.shell.quote_arg (a layer above): a leading ~/ stays for the shell to expand."""
    return "~/" + shlex.quote(arg[2:]) if arg.startswith("~/") and len(arg) > 2 else shlex.quote(arg)


def watch_script(inv: Inventory, poll: float = HOLD_POLL) -> str:
    """The lease watch (sh, run on the allocation's first node): once the lease lapsed, scancel."""
    assert inv.slurm is not None
    node = inv.slurm.node
    python = node.base_python if node.managed else node.python
    lease = posixpath.join(node.workdir, inv.cluster, "lease.json")
    # A python that is not there (`up` says so in its check) must not end the job: hold. The
    # process holding is exec'd, never waited for (it execs scancel itself): the SIGTERM of the
    # job's end reaches it, not a shell, whose wait would hold the job's end.
    py = quote_arg(python)
    return (f"command -v {py} >/dev/null 2>&1 || exec sleep infinity; "
            f"exec {py} -c {shlex.quote(script_text('lease_watch.py'))} {quote_arg(lease)} {poll:g}")


def watch_argv(inv: Inventory, job: str, node: str) -> list[str]:
    """The lease watch as a job step of `job` on `node` (its first), started detached on the login host."""
    return step_argv(job, node, ["sh", "-c", watch_script(inv)], name=f"{job_name(inv.cluster)}-lease")


def watch_command(inv: Inventory) -> str:
    """The lease watch (watch_argv) as sh for the wait (wait_argv's `then`), which starts it once the
    job runs: its job and first node are the wait's own $job and $first."""
    # (shlex leaves @ unquoted: the placeholders become the variables, the rest stays quoted)
    return shlex.join(watch_argv(inv, "@JOB@", "@NODE@")).replace("@JOB@", '"$job"').replace("@NODE@", '"$first"')


def job_name(cluster: str) -> str:
    return f"dtf-{cluster}"


def salloc_argv(inv: Inventory) -> list[str]:
    """Ask for the allocation: salloc prints `Pending job allocation ID` (or `Granted ...`) at once
    on stderr, waits while the job pends, and exits once it is granted (--no-shell: it runs
    nothing, the job holds its nodes until scancel or its time limit). Not a batch job: Slurm
    grants it in the request where the nodes are free, and never requeues it (a requeued
    allocation would hold new nodes with none of dtf's tasks on them)."""
    spec, cluster = inv.slurm, inv.cluster
    assert spec is not None and spec.nodes is not None, "an existing job is never submitted"
    argv = ["salloc", "--no-shell", f"--job-name={job_name(cluster)}", f"--nodes={spec.nodes}",
            "--ntasks-per-node=1"]
    for option, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account),
                          ("qos", spec.qos)):
        if value is not None:
            argv.append(f"--{option}={value}")
    if spec.gpus_per_node:
        argv.append(f"--gpus-per-node={spec.gpus_per_node}")
    return [*argv, *spec.sbatch]


def parse_job_id(out: str) -> str:
    """The job id on the wait's `JOB ID` line (ValueError if there is none)."""
    job = out.strip().split(";", 1)[0]
    if not job.isdigit():
        raise ValueError(f"salloc answered {out.strip()[:200]!r}, not a job id")
    return job


# squeue's view of one job: state, reason, node list, time used and left (one line, '|' between).
SQUEUE_FORMAT = "%T|%r|%N|%M|%L"


def squeue_argv(job: str) -> list[str]:
    return ["squeue", "--noheader", f"--jobs={job}", f"--format={SQUEUE_FORMAT}"]


@dataclass(frozen=True)
class JobState:
    state: str  # PENDING, RUNNING, COMPLETING, ...; "" once squeue no longer lists the job
    reason: str  # Slurm's reason (pending: Resources, Priority, ReqNodeNotAvail...); "None" when running
    nodelist: str  # compressed (node[1-3]); "" while pending
    used: str = ""
    left: str = ""

    @property
    def gone(self) -> bool:
        return not self.state


def parse_squeue(out: str) -> JobState:
    """squeue_argv's answer. squeue of a job it no longer knows prints nothing (or fails with
    'Invalid job id specified': the caller passes "" then)."""
    line = next((x for x in out.splitlines() if x.strip()), "")
    if not line:
        return JobState("", "", "")
    parts = (line.split("|") + [""] * 5)[:5]
    return JobState(*(p.strip() for p in parts))


def show_job_argv(job: str) -> list[str]:
    """The job's record (JobState, Reason, RunTime, TimeLimit...): slurmctld keeps a finished job's
    for MinJobAge (slurm.conf(5); 300 seconds by default), where squeue no longer lists it."""
    return ["scontrol", "--oneliner", "show", "job", job]


_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|$)")


def fields(line: str) -> dict[str, str]:
    """`Key=value` fields of one line of `scontrol --oneliner show`; a value may hold spaces
    (`Reason=Not responding [slurm@...]`): it runs up to the next ` Key=`."""
    return {m.group(1): m.group(2).strip() for m in _FIELD.finditer(line.strip())}


# What a job's end means, by Slurm's JobState, for the one line `status` and `train` say.
ENDINGS = {
    "TIMEOUT": "reached its time limit",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost a node",
    "CANCELLED": "was cancelled",
    "DEADLINE": "reached its deadline",
    "BOOT_FAIL": "failed to boot its nodes",
    "OUT_OF_MEMORY": "ran out of memory",
    "FAILED": "failed",
    "COMPLETED": "ended",
}
BAD_NODE = ("DOWN", "FAIL", "NOT_RESPONDING", "DRAIN")  # parts of a node's State that lose its tasks


def ended_line(job: str, show_job: str, show_nodes: str = "") -> str:
    """One line on why a job no longer runs, from `scontrol show job` (empty: Slurm forgot it) and,
    for its nodes, `scontrol show node`: e.g. "slurm job 42 lost a node (NODE_FAIL: h2 DOWN+NOT_RESPONDING,
    Not responding); its tasks ended with it"."""
    job_line = next((x for x in show_job.splitlines() if x.strip()), "")
    if not job_line:
        return (f"slurm job {job} is no longer in the queue, and Slurm no longer says why (it keeps a "
                f"finished job for MinJobAge): its tasks ended with it")
    f = fields(job_line)
    state = f.get("JobState", "?")
    reason = f.get("Reason", "None")
    bad = []
    for line in show_nodes.splitlines():
        node = fields(line)
        if "NodeName" in node and any(b in node.get("State", "") for b in BAD_NODE):
            why = node.get("Reason", "")
            bad.append(f"node {node['NodeName']} {node.get('State')}" + (f": {why}" if why else ""))
    running = state in ("RUNNING", "COMPLETING")
    what = "lost a node" if running and bad else ENDINGS.get(state, f"is {state}")
    detail = [state]
    if state == "TIMEOUT" and f.get("TimeLimit"):
        detail.append(f"time limit {f['TimeLimit']}")
    elif reason not in ("None", ""):
        detail.append(reason)
    detail += bad
    tail = ("it waits in the queue again, without dtf's tasks" if state == "PENDING" else
            "its tasks there are lost (Slurm ends the job when the node times out)" if running
            else "its tasks ended with it")
    return f"slurm job {job} {what} ({'; '.join(detail)}): {tail}"


# One command on the login host per look at a job that `up` waits for, submitting it first or
# not (scripts/wait.sh, wait_argv): squeue every WAIT_PAUSE seconds for up to WAIT_SECONDS until
# the job leaves the pending states; once it runs, its nodes and their addresses in the same
# answer, and the lease watch started. ID_SECONDS: what salloc gets to say its job id.
WAIT_SECONDS, WAIT_PAUSE, ID_SECONDS = 1.0, 0.1, 20
# THEN (the lease watch) starts this long after the job runs: its srun, slurmstepd and python
# would share the login host's and the first node's cores with the nodes' own start, which `up`
# waits for. The watch acts on a lease that ends minutes or hours later; it takes as its own a
# lease written from 1 s before it began (scripts/lease_watch.py), which `up`'s last write, once
# the servers serve, is.
WATCH_DELAY = 0.5


def wait_argv(job: str | None = None, submit: list[str] | None = None, seconds: float = WAIT_SECONDS,
              pause: float = WAIT_PAUSE, then: str | None = None) -> list[str]:
    """Look at `job` until it leaves the pending states (squeue `pause` apart, for up to `seconds`),
    or submit it first (`submit`: the salloc argv) and look at it: one command (scripts/wait.sh).
    `then`: sh to start, detached, once the job runs (watch_command)."""
    settings = {"MS": str(round(max(0.0, seconds) * 1000)), "PAUSE": f"{pause:g}", "ID_MS": str(ID_SECONDS * 1000),
                "WATCH_DELAY": f"{WATCH_DELAY:g}", "THEN": then or ""}
    program = ("; ".join(f"{name}={shlex.quote(value)}" for name, value in settings.items()) + "\n"
               + script_text("wait.sh"))
    if submit is not None:
        return ["sh", "-c", program, "sh", "--submit", "-", "-", "--", *submit]
    assert job is not None
    return ["sh", "-c", program, "sh", job]


@dataclass(frozen=True)
class Waited:
    """wait_argv's answer: the job's id (from salloc, with --submit), its state, and once it runs
    its nodes in Slurm's order and their addresses (NodeAddr)."""

    job: str | None
    state: JobState
    nodes: tuple[str, ...] = ()
    addresses: dict[str, str] | None = None


def parse_wait(out: str) -> Waited:
    lines = out.split("\n")
    job = None
    if lines and lines[0].startswith("JOB "):
        job = parse_job_id(lines.pop(0)[4:])
    parts = "\n".join(lines).split("\n---\n")
    state = parse_squeue(parts[0])
    if state.state != "RUNNING" or len(parts) < 2:
        return Waited(job, state)
    addresses = parse_node_addresses(parts[1])
    return Waited(job, state, tuple(addresses), addresses)


CANCEL_PAUSE = 0.05


def cancel_argv(job: str, seconds: float, pause: float = CANCEL_PAUSE) -> list[str]:
    """Cancel `job` and wait until the queue no longer lists it, for at most `seconds` (scripts/cancel.sh)."""
    return ["sh", "-c", script_text("cancel.sh"), "sh", job, str(max(1, round(seconds / pause))), f"{pause:g}"]


def step_argv(job: str, node: str, argv: list[str] | tuple[str, ...], name: str = "dtf") -> list[str]:
    """`argv` as a job step of `job` on `node` alone, beside the other steps there (--overlap)."""
    return ["srun", "--quiet", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            f"--job-name={name}", "--kill-on-bad-exit=0", *argv]


def layout_lines(inv: Inventory) -> list[str]:
    """The task layout of a Slurm inventory, for --dry-run: node names come with the allocation,
    so nodes are numbered in Slurm's order (as `up` will assign the task indexes)."""
    spec = inv.slurm
    assert spec is not None
    node = spec.node
    n_ps, n_workers = len(node.ps_ports), len(node.worker_ports)
    head = (f"each node: {n_ps} ps, {n_workers} workers (python {node.python}, workdir {node.workdir})"
            + (f", {len(node.gpus)} GPUs shared among its workers" if node.gpus else ""))
    if spec.nodes is None:
        return [f"{head}; the nodes are job {spec.job}'s", *_node_line("node i", node.ps_ports, node.worker_ports,
                                                                          "i", n_ps, n_workers)]
    lines = [f"{head}; {spec.nodes} nodes: {spec.nodes * n_ps} ps, {spec.nodes * n_workers} workers"]
    for i in range(min(spec.nodes, 8)):
        lines += _node_line(f"node {i}", node.ps_ports, node.worker_ports, i, n_ps, n_workers)
    if spec.nodes > 8:
        lines.append(f"  ... and so on to node {spec.nodes - 1}")
    return lines


def _node_line(label: str, ps: tuple[int, ...], workers: tuple[int, ...], i: int | str, n_ps: int,
               n_workers: int) -> list[str]:
    def index(k: int, n: int) -> str:
        return str(i * n + k) if isinstance(i, int) else f"{n}i+{k}" if n > 1 else f"i+{k}" if k else "i"

    tasks = [f"ps:{index(k, n_ps)} :{p}" for k, p in enumerate(ps)]
    tasks += [f"worker:{index(k, n_workers)} :{p}" for k, p in enumerate(workers)]
    return [f"  {label}: " + ", ".join(tasks)]


def request(inv: Inventory) -> tuple[str, ...]:
    """What an allocation for this inventory is made from: the salloc command (or the job's id)."""
    assert inv.slurm is not None
    return tuple(salloc_argv(inv)) if inv.slurm.submits else ("job", str(inv.slurm.job))


def show_nodes_argv(nodes: tuple[str, ...] | list[str]) -> list[str]:
    """One line per node, `NodeName=... NodeAddr=...` among its fields."""
    return ["scontrol", "--oneliner", "show", "node", ",".join(nodes)]


def parse_node_addresses(out: str) -> dict[str, str]:
    """NodeName: NodeAddr (the name where it has none) of `scontrol --oneliner show node`'s lines,
    in their order."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found


def gpu_options(request: tuple[str, ...] | list[str]) -> list[str]:
    """The GPU request of the allocation (`--gpus-per-node=N`, or the `--gres=...` as given in
    `sbatch:`), from its salloc command: a job step of the program's copies asks for the same,
    so that Slurm hands the step the node's GPUs as it would to the user's own `srun`."""
    return [a for a in request if a.startswith(("--gpus-per-node=", "--gres="))]


def program_step_argv(job: str, nodes: list[str] | tuple[str, ...], per_node: int, cluster: str,
                      argv: list[str], gpus: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Collective mode: ONE job step of `per_node` tasks on each node, task r on node r // per_node
    (block distribution, nodes in Slurm's order): each runs `argv`, which picks its copy by
    SLURM_PROCID. One step for all, so that each copy sees the step's own Slurm environment
    (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE) as under the
    user's own `srun`: what SlurmClusterResolver reads. --overcommit: the allocation holds one CPU a
    node (dtf's own steps share it, --overlap), the copies may be more than that. `gpus`: the
    allocation's GPU request (gpu_options), for the step."""
    return ["srun", "--quiet", f"--jobid={job}", "--overlap", "--overcommit", f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * per_node}", f"--ntasks-per-node={per_node}", f"--nodelist={','.join(nodes)}",
            "--distribution=block", *gpus, f"--job-name=dtf-{cluster}-program", "--kill-on-bad-exit=0", *argv]


def request_lines(inv: Inventory) -> list[str]:
    """--dry-run of a Slurm inventory: what `up` submits through the login host, and the layout."""
    from dtf.hosts.shell import render

    spec = inv.slurm
    assert spec is not None
    login = spec.login
    target = "ssh " + " ".join(filter(None, [f"-l {login.user}" if login.user else "",
                                             f"-p {login.port}" if login.port else "",
                                             f"-i {login.identity_file}" if login.identity_file else "", login.host]))
    lines = [f"cluster {inv.cluster} (from {inv.path}): a Slurm allocation, through the login host ({target})"]
    if spec.submits:
        lines += [f"  submit   {render(salloc_argv(inv))}",
                  "           (cancelled by `dtf down`, and by Ctrl-C or --slurm-wait while it pends; a job step "
                  "on its first node cancels it when the cluster's lease lapses there)"]
    else:
        lines.append(f"  use      job {spec.job}, an allocation you made: never cancelled by dtf")
    lines.append("  each node's tasks: a job step, " + render(step_argv(spec.job or "ID", "NODE", ["..."])))
    return lines + layout_lines(inv)


def gpu_note(gpus: Sequence[int] | None, workers: int) -> str | None:
    """Why SlurmClusterResolver's own split of a node's GPUs among its `workers` tasks (block k of
    N // W ids) would not be dtf's shares; None when they agree (or there are no GPUs)."""
    if not gpus or workers <= 0:
        return None
    n = len(gpus)
    if n < workers:
        return (f"{n} GPU(s) per node for {workers} workers per node: dtf shares them round-robin, but "
                f"SlurmClusterResolver gives each task {n} // {workers} = 0 and fails; a program reading "
                f"TF_CONFIG is fine")
    if n % workers:
        return (f"{n} GPUs per node do not split evenly among {workers} workers per node: dtf gives the "
                f"first workers one more, SlurmClusterResolver gives each {n // workers} and leaves "
                f"{n % workers} unused (its auto_set_gpu overrides dtf's CUDA_VISIBLE_DEVICES)")
    return None
