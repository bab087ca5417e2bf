"""A cluster's Slurm allocation, through its login host: ask for it (`salloc --no-shell`, or take
the inventory's `job:`), wait until it runs (saying why it pends, up to a deadline), learn its
nodes, start its lease watch; and at `down`, cancel the one dtf submitted and wait until the
queue no longer lists it. A start that fails, runs past its deadline or is interrupted (Ctrl-C)
cancels what it submitted.

Nothing here prints: what the wait looks like goes through `say`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from dtf.cluster.allocation import Allocation
from dtf.cluster.inventory import HostSpec, Inventory
from dtf.cluster.plan import DEFAULT_TTL
from dtf.errors import ClusterChanged, HostFailure
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.connections import Connections
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.providers.slurm import commands as slurm
from dtf.providers.slurm.commands import JobState

# While a job pends: squeue often at first, on the login host (a free partition starts a job in a
# second or two: slurm.wait_argv's looks), then a look a second or so (a long wait must not load
# slurmctld): POLL_MAX seconds between two looks after the first 5 s.
POLL_MAX = 1.0
CANCEL_TIMEOUT = 60.0  # seconds a cancelled job gets to leave the queue
QUERY_TIMEOUT = 30.0  # seconds for one Slurm command on the login host

if TYPE_CHECKING:
    from dtf.cluster.state import Record

Say = Callable[[str], None]


def login_master(login: HostSpec, cluster: str, ssh_config: str | None, connect_timeout: float = CONNECT_TIMEOUT,
                 ttl: float = DEFAULT_TTL) -> CommandRunner:
    """The login host's runner, over the cluster's connection to it (dtf.hosts.connections: an
    OpenSSH master where there is an `ssh`): `up`'s allocation and every job step of its nodes
    share one connection, a round trip each, not a handshake; kept `ttl` seconds after its last
    use, closed by `down` (close_masters) or by `release`."""
    from dtf.cluster import state

    return Connections(state.home(), cluster, ssh_config, connect_timeout).runner(login, ttl)


def login_args(inv: Inventory, connect_timeout: float = CONNECT_TIMEOUT,
               ttl: float | None = None) -> tuple[HostSpec, str, str | None, float, float]:
    """login_master's arguments for an inventory's `up`."""
    assert inv.slurm is not None
    return inv.slurm.login, inv.cluster, inv.ssh_config, connect_timeout, DEFAULT_TTL if ttl is None else ttl


def login_runner(inv: Inventory, connect_timeout: float = CONNECT_TIMEOUT, ttl: float | None = None
                    ) -> CommandRunner:
    """`up`'s runner of the login host: the cluster's master (login_master)."""
    return login_master(*login_args(inv, connect_timeout, ttl))


def close_masters(cluster: str) -> None:
    """Close the cluster's masters (the login host's among them)."""
    from dtf.cluster import state

    Connections(state.home(), cluster).close()


def _run(t: CommandRunner, argv: list[str], what: str) -> str:
    r = t.run(argv, timeout=QUERY_TIMEOUT)
    if not r.ok:
        err = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
        raise HostError(f"{what} failed: {err}")
    return r.stdout


def job_state(t: CommandRunner, job: str) -> JobState:
    r = t.run(slurm.squeue_argv(job), timeout=QUERY_TIMEOUT)
    if not r.ok and "Invalid job id" in r.stderr:  # squeue forgets a finished job: it is gone
        return JobState("", "", "")
    if not r.ok:
        raise HostError(f"squeue failed: {(r.stderr.strip().splitlines() or [f'exit {r.exit_code}'])[-1]}")
    return slurm.parse_squeue(r.stdout)


def allocate(inv: Inventory, *, wait: float, say: Say, connect_timeout: float = CONNECT_TIMEOUT,
             ttl: float | None = None) -> Allocation:
    """The running allocation of a Slurm inventory: submitted now, or the inventory's `job`.
    HostFailure (the login host, with the reason) if it cannot be had within `wait` seconds;
    what was submitted is cancelled then, and on Ctrl-C. Over the cluster's master to the login
    host (`login_master`), which `up` goes on using; closed here if it fails."""
    spec = inv.slurm
    assert spec is not None
    login = spec.login.host
    job = spec.job
    try:
        with login_runner(inv, connect_timeout, ttl) as t:
            waited: slurm.Waited | None = None
            # The lease watch of a job dtf submits: started by the look that finds it running.
            watch = slurm.watch_command(inv) if spec.submits else None
            if spec.submits:
                submit = slurm.wait_argv(submit=slurm.salloc_argv(inv), seconds=min(slurm.WAIT_SECONDS, wait),
                                         then=watch)
                r = t.run(submit, timeout=QUERY_TIMEOUT + slurm.ID_SECONDS)
                try:  # its id, even if the look after salloc failed: it must be cancelled then
                    waited = slurm.parse_wait(r.stdout)
                    job = waited.job
                except ValueError as e:
                    raise HostError(str(e))
                if job is None:
                    raise HostError(f"salloc failed: {(r.stderr.strip().splitlines() or [f'exit {r.exit_code}'])[-1]}")
                say(f"job {job} submitted: {slurm.job_name(inv.cluster)}, {spec.nodes} node(s)")
                if not r.ok:  # salloc worked, the look after it did not: look again
                    waited = None
            assert job is not None
            try:
                if waited is None:
                    waited = _look(t, job, 0, watch)
                waited = _wait_running(t, job, waited, wait, say, watch)
            except BaseException:
                if spec.submits:
                    _cancel(t, job, say)
                raise
    except HostError as e:
        close_masters(inv.cluster)
        raise HostFailure("dtf up (Slurm)", {login: str(e)})
    except BaseException:
        close_masters(inv.cluster)
        raise
    addresses = waited.addresses or {}
    return Allocation(job=job, submitted=spec.submits, login=spec.login, nodes=waited.nodes,
                      addresses=tuple(addresses.get(n, n) for n in waited.nodes), request=slurm.request(inv))


def _look(t: CommandRunner, job: str, seconds: float = slurm.WAIT_SECONDS, then: str | None = None) -> slurm.Waited:
    """One look at the job (slurm.wait_argv: for up to `seconds` on the login host; `then` once it runs)."""
    return slurm.parse_wait(_run(t, slurm.wait_argv(job, seconds=seconds, then=then), f"looking at job {job}"))


def _wait_running(t: CommandRunner, job: str, look: slurm.Waited, wait: float, say: Say,
                  then: str | None = None) -> slurm.Waited:
    """Until the job runs (its nodes known), saying why it pends; HostError past `wait` seconds.
    `then`: what the look that finds it running starts (wait_argv)."""
    t0 = time.monotonic()
    said, last_shown = "", 0.0
    while True:
        state = look.state
        waited = time.monotonic() - t0
        if state.state == "RUNNING":
            if not look.nodes:
                raise HostError(f"job {job} runs, but Slurm named none of its nodes ({state.nodelist!r})")
            say(f"job {job} runs on {state.nodelist} (waited {waited:.0f}s)")
            return look
        if state.gone or state.state not in ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING"):
            raise HostError(f"job {job} is {state.state or 'no longer in the queue'}"
                            + (f" ({state.reason})" if state.reason and state.reason != "None" else ""))
        line = f"job {job}: {state.state} ({state.reason})"
        if line != said or time.monotonic() - last_shown >= 10:
            say(f"{line}, waited {waited:.0f}s")
            said, last_shown = line, time.monotonic()
        if waited >= wait:
            raise HostError(f"job {job} still {state.state} after {wait:g}s ({state.reason}): cancelled")
        if waited >= 5:  # a long wait must not load slurmctld: a look a second or so
            time.sleep(min(POLL_MAX, max(0.0, wait - waited)))
        look = _look(t, job, min(slurm.WAIT_SECONDS, max(0.0, wait - (time.monotonic() - t0))), then)


def _cancel(t: CommandRunner, job: str, say: Say) -> float:
    """scancel, then wait until squeue no longer lists the job (one command on the login host:
    slurm.cancel_argv); the seconds that took."""
    t0 = time.monotonic()
    r = t.run(slurm.cancel_argv(job, CANCEL_TIMEOUT), timeout=CANCEL_TIMEOUT + QUERY_TIMEOUT)
    if r.exit_code == 3:
        last = (r.stderr.strip().splitlines() or [""])[-1]
        raise HostError(f"job {job} still in the queue {CANCEL_TIMEOUT:g}s after scancel"
                        + (f" ({last})" if last else ""))
    if not r.ok:
        raise HostError(f"scancel failed: {(r.stderr.strip().splitlines() or [f'exit {r.exit_code}'])[-1]}")
    seconds = time.monotonic() - t0
    say(f"job {job} cancelled; the queue no longer lists it ({seconds:.1f}s)")
    return seconds


def release(allocation: Allocation, ssh_config: str | None, say: Say,
            connect_timeout: float = CONNECT_TIMEOUT, *, cluster: str) -> float | None:
    """`down`: cancel the job dtf submitted and wait until it has left the queue (seconds it
    took); a job the user made is left running (None). The cluster's masters are closed after
    (an `up` that failed after its allocation, `down`)."""
    try:
        if not allocation.submitted:
            say(f"job {allocation.job} is yours (the inventory's job:): left running")
            return None
        with login_master(allocation.login, cluster, ssh_config, connect_timeout) as t:
            return _cancel(t, allocation.job, say)
    except HostError as e:
        raise HostFailure("dtf down (Slurm)", {allocation.login.host: str(e)})
    finally:
        close_masters(cluster)


def cancel_ended(allocation: Allocation, cluster: str, ssh_config: str | None, ttl: float,
                 connect_timeout: float = CONNECT_TIMEOUT) -> bool:
    """What is left of a job dtf submitted that has ended or lost a node, cancelled (True; False:
    Slurm had ended it): scancel, not waiting until the queue no longer lists it (a job on a node
    that does not answer stays there, COMPLETING, until Slurm marks the node down: SlurmdTimeout).
    Slurm gives none of its nodes to another job before it has ended the job's steps there. Over
    the cluster's master to the login host, opened again for `ttl` if it has gone."""
    assert allocation.submitted
    try:
        with login_master(allocation.login, cluster, ssh_config, connect_timeout, ttl) as t:
            state = job_state(t, allocation.job).state
            if state in ("", "COMPLETING", *slurm.ENDINGS):
                return False
            _run(t, ["scancel", allocation.job], "scancel")
            return True
    except HostError as e:
        raise HostFailure("dtf train (Slurm)", {allocation.login.host: str(e)})


def allocation_state(allocation: Allocation, cluster: str, ssh_config: str | None, ttl: float,
                     connect_timeout: float = CONNECT_TIMEOUT, what: str = "dtf status") -> tuple[JobState, str | None]:
    """The job's state as squeue shows it (`status`, `train`), and unless it runs, one line on
    why: Slurm's state and reason (time limit, preemption, a lost node and the node's own reason).
    Over the cluster's master to the login host (login_master: a round trip, not a handshake; the
    nodes' own questions go over it too), opened again for `ttl` if it has gone."""
    try:
        with login_master(allocation.login, cluster, ssh_config, connect_timeout, ttl) as t:
            state = job_state(t, allocation.job)
            if state.state in ("RUNNING", "COMPLETING") and not bad_nodes(t, allocation):
                return state, None
            return state, ended(t, allocation)
    except HostError as e:
        raise HostFailure(f"{what} (Slurm)", {allocation.login.host: str(e)})


def bad_nodes(t: CommandRunner, allocation: Allocation) -> bool:
    """Whether a node of the allocation is down or not responding (its tasks are lost, even while
    Slurm has not ended the job yet: that waits for SlurmdTimeout)."""
    r = t.run(slurm.show_nodes_argv(allocation.nodes), timeout=QUERY_TIMEOUT)
    return r.ok and any(any(b in slurm.fields(line).get("State", "") for b in slurm.BAD_NODE)
                        for line in r.stdout.splitlines())


def ended(t: CommandRunner, allocation: Allocation) -> str:
    """One line on why the allocation's job no longer runs (dtf.providers.slurm.commands.ended_line)."""
    job = t.run(slurm.show_job_argv(allocation.job), timeout=QUERY_TIMEOUT)
    nodes = t.run(slurm.show_nodes_argv(allocation.nodes), timeout=QUERY_TIMEOUT)
    return slurm.ended_line(allocation.job, job.stdout if job.ok else "", nodes.stdout if nodes.ok else "")


def detach_step(t: CommandRunner, argv: list[str]) -> None:
    """Start `argv` (an `srun` of a job step) on the login host, detached from the SSH session
    (scripts/detach.sh): the step lives as long as its srun does, and ends with the job."""
    r = t.run(["sh", "-c", slurm.script_text("detach.sh"), "sh", *argv], timeout=QUERY_TIMEOUT)
    if not r.ok:
        raise HostError(f"starting a job step failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


@contextlib.contextmanager
def allocated(inv: Inventory, *, wait: float, say: Say, connect_timeout: float, replace: bool,
              ttl: float | None, take_down: Callable[[Record], None]) -> Iterator[Allocation]:
    """`up`'s allocation (`up_allocation`), for the block that starts the cluster on it. One made
    for this `up` is released (cancelled, its masters closed) when the block raises, Ctrl-C
    included: one is kept only for a cluster that started."""
    allocation, fresh = up_allocation(inv, wait=wait, say=say, connect_timeout=connect_timeout, replace=replace,
                                      ttl=ttl, take_down=take_down)
    try:
        yield allocation
    except BaseException:
        if fresh:
            release(allocation, inv.ssh_config, say, connect_timeout, cluster=inv.cluster)
        raise


def up_allocation(inv: Inventory, *, wait: float, say: Say, connect_timeout: float, replace: bool,
                  ttl: float | None, take_down: Callable[[Record], None]) -> tuple[Allocation, bool]:
    """The allocation `up` runs a Slurm inventory's cluster on: the recorded cluster's, while its
    job runs and the inventory asks for the same one (an `up` again repairs it), else a new one
    (True: made now, so an `up` that fails cancels it). An inventory that asks for another
    allocation than the running one is refused (ClusterChanged); `replace` takes the recorded
    cluster down (`take_down`, its job with it) and starts anew."""
    from dtf.cluster import state

    if inv.cluster in state.names():
        record = state.load(inv.cluster)
        recorded = record.plan.allocation
        if replace:
            take_down(record)
        elif recorded is not None:
            try:
                with login_runner(inv, connect_timeout, ttl) as t:
                    job = job_state(t, recorded.job)
            except HostError as e:
                raise HostFailure("dtf up (Slurm)", {recorded.login.host: str(e)})
            if job.state == "RUNNING" and recorded.request != slurm.request(inv):
                raise ClusterChanged(inv.cluster, record.inventory, inv.path, [
                    f"slurm: job {recorded.job} was made by {' '.join(recorded.request)[:300]}",
                    f"slurm: this inventory asks for {' '.join(slurm.request(inv))[:300]}"])
            if job.state == "RUNNING":
                return recorded, False
            if job.gone:  # its lease lapsed, it ran out of time, or someone cancelled it
                with state.locked():
                    state.remove(inv.cluster)
                say(f"job {recorded.job} of cluster {inv.cluster} is no longer in the queue "
                    f"(its tasks ended with it): starting the cluster anew")
    return allocate(inv, wait=wait, say=say, connect_timeout=connect_timeout, ttl=ttl), True
