"""A cluster's Slurm allocation, through its login host: submit it (or take the inventory's
`job:`), wait until it runs (saying why it pends, up to a deadline), learn its nodes; and at
`down`, cancel the one dtf submitted and wait until the queue no longer lists it. A start that
fails, runs past its deadline or is interrupted (Ctrl-C) cancels what it submitted.

Nothing here prints: what the wait looks like goes through `say`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dtf.cluster import slurm
from dtf.cluster.inventory import Inventory
from dtf.cluster.slurm import Allocation, JobState
from dtf.errors import HostFailure
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.hosts.transport import HostError, SSHTransport, Transport

# Seconds between two squeue while a job pends: often at first (a free partition starts a job in
# a second or two), then at most once a second (a long wait must not load slurmctld).
POLL, POLL_MAX = 0.2, 1.0
CANCEL_TIMEOUT = 60.0  # seconds a cancelled job gets to leave the queue
QUERY_TIMEOUT = 30.0  # seconds for one Slurm command on the login host

Say = Callable[[str], None]


def login_transport(inv: Inventory, connect_timeout: float = CONNECT_TIMEOUT) -> SSHTransport:
    assert inv.slurm is not None
    return SSHTransport(inv.slurm.login, inv.ssh_config, connect_timeout)


def _run(t: Transport, argv: list[str], what: str) -> str:
    r = t.run(argv, timeout=QUERY_TIMEOUT)
    if not r.ok:
        err = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
        raise HostError(f"{what} failed: {err}")
    return r.stdout


def job_state(t: Transport, job: str) -> JobState:
    r = t.run(slurm.squeue_argv(job), timeout=QUERY_TIMEOUT)
    if not r.ok and "Invalid job id" in r.stderr:  # squeue forgets a finished job: it is gone
        return JobState("", "", "")
    if not r.ok:
        raise HostError(f"squeue failed: {(r.stderr.strip().splitlines() or [f'exit {r.exit_code}'])[-1]}")
    return slurm.parse_squeue(r.stdout)


def allocate(inv: Inventory, *, wait: float, say: Say, connect_timeout: float = CONNECT_TIMEOUT) -> Allocation:
    """The running allocation of a Slurm inventory: submitted now, or the inventory's `job`.
    HostFailure (the login host, with the reason) if it cannot be had within `wait` seconds;
    what was submitted is cancelled then, and on Ctrl-C."""
    spec = inv.slurm
    assert spec is not None
    login = spec.login.host
    job = spec.job
    try:
        with login_transport(inv, connect_timeout) as t:
            if spec.submits:
                out = _run(t, slurm.sbatch_argv(inv), "sbatch")
                try:
                    job = slurm.parse_job_id(out)
                except ValueError as e:
                    raise HostError(str(e))
                say(f"job {job} submitted: {slurm.job_name(inv.cluster)}, {spec.nodes} node(s)")
            assert job is not None
            try:
                state = _wait_running(t, job, wait, say)
                nodes = tuple(_run(t, slurm.hostnames_argv(state.nodelist), "scontrol show hostnames").split())
                addresses = slurm.parse_node_addresses(_run(t, slurm.show_nodes_argv(nodes), "scontrol show node"))
            except BaseException:
                if spec.submits:
                    _cancel(t, job, say)
                raise
    except HostError as e:
        raise HostFailure("dtf up (Slurm)", {login: str(e)})
    return Allocation(job=job, submitted=spec.submits, login=spec.login, nodes=nodes,
                      addresses=tuple(addresses.get(n, n) for n in nodes), request=slurm.request(inv))


def _wait_running(t: Transport, job: str, wait: float, say: Say) -> JobState:
    t0 = time.monotonic()
    shown, last_shown = "", 0.0
    while True:
        state = job_state(t, job)
        waited = time.monotonic() - t0
        if state.state == "RUNNING":
            say(f"job {job} runs on {state.nodelist} (waited {waited:.0f}s)")
            return state
        if state.gone or state.state not in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING"):
            raise HostError(f"job {job} is {state.state or 'no longer in the queue'}"
                            + (f" ({state.reason})" if state.reason and state.reason != "None" else ""))
        line = f"job {job}: {state.state} ({state.reason})"
        if line != shown or time.monotonic() - last_shown >= 10:
            say(f"{line}, waited {waited:.0f}s")
            shown, last_shown = line, time.monotonic()
        if waited >= wait:
            raise HostError(f"job {job} still {state.state} after {wait:g}s ({state.reason}): cancelled")
        time.sleep(min(POLL if waited < 5 else POLL_MAX, max(0.0, wait - waited)))


def _cancel(t: Transport, job: str, say: Say) -> float:
    """scancel, then wait until squeue no longer lists the job; the seconds that took."""
    t0 = time.monotonic()
    _run(t, slurm.scancel_argv(job), "scancel")
    deadline = t0 + CANCEL_TIMEOUT
    while not job_state(t, job).gone:
        if time.monotonic() > deadline:
            raise HostError(f"job {job} still in the queue {CANCEL_TIMEOUT:g}s after scancel")
        time.sleep(0.2)
    seconds = time.monotonic() - t0
    say(f"job {job} cancelled; the queue no longer lists it ({seconds:.1f}s)")
    return seconds


def release(allocation: Allocation, ssh_config: str | None, say: Say,
            connect_timeout: float = CONNECT_TIMEOUT) -> float | None:
    """`down`: cancel the job dtf submitted and wait until it has left the queue (seconds it
    took); a job the user made is left running (None)."""
    if not allocation.submitted:
        say(f"job {allocation.job} is yours (the inventory's job:): left running")
        return None
    try:
        with SSHTransport(allocation.login, ssh_config, connect_timeout) as t:
            return _cancel(t, allocation.job, say)
    except HostError as e:
        raise HostFailure("dtf down (Slurm)", {allocation.login.host: str(e)})


def allocation_state(allocation: Allocation, ssh_config: str | None,
                     connect_timeout: float = CONNECT_TIMEOUT, what: str = "dtf status") -> tuple[JobState, str | None]:
    """The job's state as squeue shows it (`status`, `train`), and unless it runs, one line on
    why: Slurm's state and reason (time limit, preemption, a lost node and the node's own reason)."""
    try:
        with SSHTransport(allocation.login, ssh_config, connect_timeout) as t:
            state = job_state(t, allocation.job)
            if state.state in ("RUNNING", "COMPLETING") and not bad_nodes(t, allocation):
                return state, None
            return state, ended(t, allocation)
    except HostError as e:
        raise HostFailure(f"{what} (Slurm)", {allocation.login.host: str(e)})


def bad_nodes(t: Transport, allocation: Allocation) -> bool:
    """Whether a node of the allocation is down or not responding (its tasks are lost, even while
    Slurm has not ended the job yet: that waits for SlurmdTimeout)."""
    r = t.run(slurm.show_nodes_argv(allocation.nodes), timeout=QUERY_TIMEOUT)
    return r.ok and any(any(b in slurm.fields(line).get("State", "") for b in slurm.BAD_NODE)
                        for line in r.stdout.splitlines())


def ended(t: Transport, allocation: Allocation) -> str:
    """One line on why the allocation's job no longer runs (dtf.cluster.slurm.ended_line)."""
    job = t.run(slurm.show_job_argv(allocation.job), timeout=QUERY_TIMEOUT)
    nodes = t.run(slurm.show_nodes_argv(allocation.nodes), timeout=QUERY_TIMEOUT)
    return slurm.ended_line(allocation.job, job.stdout if job.ok else "", nodes.stdout if nodes.ok else "")


def detach_steps(t: Transport, argvs: list[list[str]]) -> None:
    """Start each argv (an `srun` of a job step) on the login host, detached from the SSH session:
    the step lives as long as its srun does, and ends with the job."""
    from dtf.hosts.shell import render

    # One SSH command for all of them: each srun, detached, in a session of its own.
    script = "\n".join(f"setsid -f {render(argv)} >/dev/null 2>&1 </dev/null" for argv in argvs)
    r = t.run(["sh", "-c", script], timeout=QUERY_TIMEOUT)
    if not r.ok:
        raise HostError(f"starting a job step failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
