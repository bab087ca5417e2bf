"""Acting on a plan: start, inspect and stop the servers of every host, all hosts in parallel.

Each host gets one thread, its own connection and a deadline on every step; the result is one
outcome per host (Fabric's GroupResult habit) and one combined HostFailure listing every host that
failed. Nothing here prints: progress goes through a callback, so the CLI decides how it looks.

Every launcher command's reply is decoded once, here, into the types of `dtf_server.protocol`;
what a task's state is, is decided once, by `TaskStatus.state`, and `task_states` gives it for
every task of a plan.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from dtf.cluster.plan import HostPlan, Plan, TaskPlan
from dtf.files import environment, relay, shipping, sync
from dtf.hosts.netutil import CONNECT_TIMEOUT, port_open, wait_port
from dtf.hosts.transport import HostError, Result, Transport, transport_for
from dtf_server import layout, protocol
from dtf_server.procs import tf_version
from dtf_server.protocol import (
    CheckReply,
    CleanReply,
    Defaults,
    EnvReply,
    FenceReply,
    FetchReply,
    ProtocolMismatch,
    PurgeReply,
    R,
    ReachReply,
    RenewReply,
    StartReply,
    StatusReply,
    StopReply,
    SyncReply,
    TaskStatus,
    TaskStopped,
)

Progress = Callable[[str, str], None]  # (host, what it is doing now)
STOP_GRACE = Defaults.STOP_GRACE
RENEW_TIMEOUT = 15.0
REACH_TIMEOUT = 15.0  # seconds the laptop gives a started server's port to accept a connection
DIRECT_PROBE = 2.0  # seconds a direct connection gets in ssh and auto mode (a dropping firewall: all of them)
MESH_TIMEOUT = 5.0  # seconds each host gives a connection to another host's task
FILES_GONE = "dtf's files are gone from {root} (lease lapsed?)"

T = TypeVar("T")


def local_tf_version() -> str | None:
    """The laptop's TensorFlow version, asked the same way the launcher asks on each host."""
    return tf_version()


@dataclass
class Outcome(Generic[T]):
    host: str
    ok: bool
    reason: str = ""
    data: T | None = None
    seconds: float = 0.0

    @property
    def value(self) -> T:
        """The data of a host that succeeded."""
        assert self.ok and self.data is not None, self
        return self.data


ENV_BUILD_TIMEOUT = 1800.0  # seconds a managed environment's build may take on a host
# A managed environment takes about 4.5 times its wheels on disk (tensorflow-cpu 2.21: 334 MB of
# wheels, 1.5 GB installed); `up` refuses a host with less free space than wheels + this.
ENV_SIZE_FACTOR = 4.5
ENV_MIN_FREE = 2_000_000_000  # bytes: less than this free, and no TensorFlow environment fits


@dataclass(frozen=True)
class EnvReport:
    """What `up` did about a host's managed environment, and how long each phase took."""

    dir: str
    reused: bool  # complete already: one check, nothing built
    seconds: dict[str, float] = field(default_factory=dict)  # resolve, send, create, install
    size: int = 0  # bytes on the host (0: not measured, reused)
    sent: int = 0  # bytes sent from this machine
    copied: int = 0  # bytes of wheels copied from another host of the cluster


@dataclass(frozen=True)
class HostStarted:
    pids: dict[str, int]  # task -> its supervisor's pid
    client_address: str | None  # the laptop's address as the host saw it
    direct: bool = True  # its tasks' TF ports accept connections from this machine directly
    env: EnvReport | None = None  # `python: managed`


@dataclass(frozen=True)
class HostStopped:
    stopped: dict[str, TaskStopped]
    removed: list[str] = field(default_factory=list)
    purged: PurgeReply | None = None  # `down --purge`: WORKDIR/.cache removed (or why not)


@dataclass(frozen=True)
class TaskState:
    """One task of a plan, as its host reported it: `state` is alive, restarting, failed, dead,
    or unknown (its host could not be asked: `reason` says why)."""

    task: TaskPlan
    state: str
    reason: str | None
    status: TaskStatus | None  # None when unknown


def task_states(plan: Plan, outcomes: dict[str, Outcome[StatusReply]]) -> list[TaskState]:
    """Every task's state, ps first (the one place that turns status replies into states)."""
    states = []
    for t in plan.tasks():
        o = outcomes[t.host]
        if not o.ok:
            states.append(TaskState(t, "unknown", o.reason, None))
            continue
        status = o.value.tasks.get(t.name) or TaskStatus.dead("not reported by its host")
        states.append(TaskState(t, status.state, status.reason, status))
    return states


class Cancelled(Exception):
    pass


class LauncherMissing(Exception):
    """The launcher is not at its path on the host (a new cluster, another dtf version's files,
    or the cluster's files were removed)."""


def _no_progress(host: str, step: str) -> None:
    pass


def _probe_all(probe: Callable[[TaskPlan], bool], tasks: Sequence[TaskPlan]) -> list[bool]:
    """`probe` each task, all at once: a host that drops packets costs one timeout, not one per task."""
    if not tasks:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(tasks)), thread_name_prefix="dtf-probe") as pool:
        return list(pool.map(probe, tasks))


class ClusterOps:
    """Operations on the hosts of one plan."""

    def __init__(self, plan: Plan, progress: Progress = _no_progress,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.plan = plan
        self.progress = progress
        self.connect_timeout = connect_timeout
        self.cancel = threading.Event()
        self.touched: set[str] = set()  # hosts `up` uploaded the launcher to
        self.started: set[str] = set()  # hosts `up` started tasks on
        self._wheels: environment.WheelCache | None = None
        self._wheels_guard = threading.Lock()
        self.relay = relay.Relay()  # wheels from host to host (managed environments)
        self.copied: dict[str, int] = {}  # host -> bytes of wheels it copied from another host

    @property
    def wheels(self) -> environment.WheelCache:
        """The laptop's wheel cache (made on first use, by the first managed host)."""
        with self._wheels_guard:
            if self._wheels is None:
                self._wheels = environment.WheelCache()
            return self._wheels

    def transport(self, hp: HostPlan) -> Transport:
        return transport_for(hp.spec, self.plan.ssh_config, self.connect_timeout)

    def each_host(self, fn: Callable[[HostPlan], T], hosts: Sequence[HostPlan] | None = None
                  ) -> dict[str, Outcome[T]]:
        """Run fn on every host in parallel; a HostError on one host is that host's outcome."""
        hosts = self.plan.hosts if hosts is None else hosts

        def one(hp: HostPlan) -> Outcome[T]:
            t0 = time.monotonic()
            try:
                data = fn(hp)
                self.progress(hp.name, "done")
                return Outcome(hp.name, True, data=data, seconds=time.monotonic() - t0)
            except (HostError, Cancelled) as e:
                self.progress(hp.name, f"failed: {e}")
                return Outcome(hp.name, False, reason=str(e), seconds=time.monotonic() - t0)
            # Anything else is a bug, not the host's failure: it is raised once every host is done
            # (the CLI shows one line and logs the traceback), never shown as "host: KeyError".

        if not hosts:
            return {}
        with ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="dtf-host") as pool:
            futures = {hp.name: pool.submit(one, hp) for hp in hosts}
            try:
                wait(futures.values())
            except KeyboardInterrupt:
                self.cancel.set()  # the threads stop at their next step; each step is bounded
                wait(futures.values())
        return {name: f.result() for name, f in futures.items()}  # raises the first bug

    def _step(self, hp: HostPlan, what: str) -> None:
        if self.cancel.is_set():
            raise Cancelled("interrupted")
        self.progress(hp.name, what)

    def _hosts_in(self, only: dict[str, set[str]]) -> tuple[HostPlan, ...]:
        return tuple(hp for hp in self.plan.hosts if only.get(hp.name))

    # -- talking to the launcher ---------------------------------------------------------------
    @staticmethod
    def _decode(kind: type[R], result: Result, what: str) -> R:
        """The launcher's reply, typed; HostError if there is none."""
        if result.exit_code == protocol.EXIT_NO_LAUNCHER and not result.stdout.strip():
            raise LauncherMissing(what)
        try:
            return protocol.decode(kind, result.stdout)
        except ProtocolMismatch:
            raise
        except ValueError as e:
            err = (result.stderr.strip().splitlines() or [str(e)])[-1]
            raise HostError(f"{what} failed (exit {result.exit_code}): {err}")

    def _upload(self, t: Transport, hp: HostPlan) -> None:
        t.put_bytes(shipping.launcher_bytes(), hp.root, shipping.launcher_name())

    def _ask(self, t: Transport, hp: HostPlan, kind: type[R], argv: list[str], what: str, timeout: float,
             upload_if: Callable[[], bool] = lambda: True) -> R:
        """Run a launcher command and decode its reply. If this dtf's launcher is not there (or
        a launcher of another protocol answered), ship it, when `upload_if()`, and ask again."""
        try:
            return self._decode(kind, t.run(argv, timeout=timeout), what)
        except (LauncherMissing, ProtocolMismatch):
            if not upload_if():
                raise
        self._upload(t, hp)
        try:
            return self._decode(kind, t.run(argv, timeout=timeout), what)
        except (LauncherMissing, ProtocolMismatch) as e:
            raise HostError(f"{what} failed: the launcher just uploaded to {hp.launcher} "
                            f"{'is not there' if isinstance(e, LauncherMissing) else e}")

    @staticmethod
    def _root_exists(t: Transport, hp: HostPlan) -> bool:
        return t.run(["test", "-d", hp.root], timeout=RENEW_TIMEOUT).ok

    # -- up ------------------------------------------------------------------------------------
    def start_host(self, hp: HostPlan, tf_version: str | None, only: Collection[str] | None = None
                   ) -> HostStarted:
        """Start the host's tasks (or those named in `only`: the others keep running)."""
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            self._step(hp, "uploading launcher")
            self.touched.add(hp.name)  # from here on, a rollback must remove what we put there
            self._upload(t, hp)
            self._step(hp, "checking python and " + ("its environment" if hp.managed else "TensorFlow"))
            r = t.run(hp.check_argv(only), timeout=30)
            if r.exit_code in (126, 127) and hp.managed:  # the shell's "not found" / "not executable"
                where = "on the PATH of an SSH command" if "/" not in hp.base_python else "there"
                raise HostError(f"no python3 on the host (looked for {hp.base_python!r} {where}; "
                                f"set base_python)")
            if r.exit_code in (126, 127):
                raise HostError(f"python missing: {hp.python!r} cannot be run there")
            check = self._decode(CheckReply, r, f"{hp.base_python or hp.python} (the host's python)")
            if hp.managed:  # its environment is checked below, once the ports are known to be free
                if tf_version and tf_version != environment.TF_VERSION:
                    raise HostError(f"TensorFlow mismatch: a managed environment holds dtf's pinned "
                                    f"{environment.TF_VERSION}, this machine has {tf_version}")
            elif check.tensorflow is None:
                raise HostError(f"TensorFlow is not installed for {hp.python} "
                                f"(install tensorflow-cpu=={tf_version} there, or set python: managed)")
            elif tf_version and check.tensorflow != tf_version:
                raise HostError(f"TensorFlow mismatch: {check.tensorflow} on the host ({hp.python}), "
                                f"{tf_version} on this machine")
            if check.running and only is None:
                raise HostError(
                    f"cluster {self.plan.cluster!r} already runs here ({', '.join(check.running)} "
                    f"in {hp.root}), started by another dtf (another DTF_HOME or machine): "
                    f"`dtf down` it there, or name this cluster differently")
            if check.busy:
                raise HostError("port busy: " + ", ".join(
                    f"{task.port} ({task.name})" for task in hp.tasks if task.port in check.busy))
            env = self._environment(t, hp, check, hp.tasks_in(only)[0].port) if hp.managed else None
            if self.plan.firewall == "members":
                self._fence(t, hp, check.client_address)
            tasks = hp.tasks_in(only)
            self._step(hp, f"starting {len(tasks)} server(s)")
            self.started.add(hp.name)  # from here on, a rollback must stop tasks there
            r = t.run(hp.start_argv_for(only), timeout=hp.start_timeout + 30)
            started = self._decode(StartReply, r, "starting servers")
            failed = {n: s for n, s in started.tasks.items() if not s.ok}
            if failed:
                name, s = next(iter(failed.items()))
                log = " | ".join(line.strip() for line in s.log_tail[-5:] if line.strip())
                raise HostError(f"server crashed: {name}: {s.reason}" + (f"; log: {log}" if log else ""))
            self._step(hp, "checking the servers are reachable from here")
            direct = self._reachable(t, hp, tasks)
        return HostStarted(pids={n: s.pid for n, s in started.tasks.items() if s.pid is not None},
                           client_address=check.client_address, direct=direct, env=env)

    def _environment(self, t: Transport, hp: HostPlan, check: CheckReply, free_port: int) -> EnvReport:
        """A managed host's environment: reused when `check` found it complete (the one cheap
        check), else resolved and fetched on this machine (cached), sent (or copied from another
        host of the cluster: see _copy_wheels), and built there. `free_port`: a planned TF port
        of this host, free until its servers start."""
        assert hp.env_dir is not None
        if check.env_ready:
            return EnvReport(dir=hp.env_dir, reused=True)
        target = environment.Target(check.machine, check.system, check.libc, check.python)
        problem = target.problem()
        if problem:
            raise HostError(problem)
        if 0 <= check.free < ENV_MIN_FREE:  # hopeless before anything is resolved or downloaded
            raise HostError(f"disk full: {_mb(check.free)} free for {hp.env_dir}, a managed environment "
                            f"needs about {_mb(ENV_MIN_FREE)} or more")
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        self._step(hp, f"resolving and fetching packages for {target.tag} / python {target.py}")
        try:
            wheels = self.wheels.wheels(hp.requirements, hp.spec.accelerator, target)
            uv = self.wheels.uv_for(target)
        except environment.EnvError as e:
            raise HostError(str(e))
        seconds["resolve"] = time.monotonic() - t0
        missing = [f for f in wheels.files if f.name not in set(check.wheels)]
        space = sum(f.stat().st_size for f in missing) + int(wheels.size * ENV_SIZE_FACTOR)
        if 0 <= check.free < space:
            raise HostError(f"disk full: {_mb(check.free)} free for {hp.env_dir}, the environment needs "
                            f"about {_mb(space)}")
        t0 = time.monotonic()
        # What this host lacks, as (file here, path below WORKDIR/.cache there): uv, and wheels.
        cache = layout.cache_dir(hp.spec.workdir)
        uv_rel = f"bin/{environment.uv_name(uv)}"
        remote_uv = posixpath.join(cache, uv_rel)
        need = [] if t.run(["test", "-x", remote_uv], timeout=30).ok else [(uv, uv_rel)]
        need += [(f, f"wheels/{f.name}") for f in missing]
        sent = 0
        seed = None
        if need:
            seed = self.relay.join(target.key, hp.name)
            if seed.host != hp.name:
                need = self._copy_wheels(t, hp, seed, need)
        try:
            total = sum(f.stat().st_size for f, _ in need)
            for i, (f, rel) in enumerate(need, 1):
                self._step(hp, f"sending {i}/{len(need)}: {f.name} ({_mb(sent)} of {_mb(total)})")
                self._send(t, hp, f, posixpath.join(cache, rel))
                sent += f.stat().st_size
            if seed is not None and seed.host == hp.name:
                self._serve_wheels(hp, seed, [(uv, uv_rel),
                                              *[(f, f"wheels/{f.name}") for f in wheels.files]], free_port)
        finally:
            if seed is not None and seed.host == hp.name:
                seed.ready.set()  # serving, or failed: the other hosts stop waiting either way
        if not t.run(["chmod", "755", remote_uv], timeout=30).ok:
            raise HostError(f"cannot make {remote_uv} executable")
        requirements = f"{hp.env_dir}.requirements.txt"
        t.put_bytes(wheels.text().encode(), posixpath.dirname(requirements), posixpath.basename(requirements))
        seconds["send"] = time.monotonic() - t0
        self._step(hp, f"building the environment ({len(wheels.pinned)} packages)")
        try:
            r = t.run(hp.env_argv(remote_uv, requirements), timeout=ENV_BUILD_TIMEOUT)
        finally:
            if seed is not None and seed.thread is not None:
                # Its servers need the port; and whatever happens here, the others may be copying.
                self._step(hp, "waiting for the other hosts to finish copying the wheels from here")
                seed.thread.join(timeout=relay.SERVE_LIMIT + 60)
        try:
            built = self._decode(EnvReply, r, "building the environment")
        except HostError:
            if r.stdout.strip() or r.exit_code >= 0:
                raise
            # No reply and killed by a signal (SSH reports -1): what was built is never used.
            raise HostError(f"the environment build in {hp.env_dir} was killed before it finished; "
                            f"the next `dtf up` builds it again")
        if not built.ok:
            raise HostError(built.error or "building the environment failed")
        seconds.update(built.seconds)
        report = EnvReport(dir=hp.env_dir, reused=built.reused, seconds=seconds, size=built.size, sent=sent,
                           copied=self.copied.get(hp.name, 0))
        self._step(hp, "environment ready: " + env_summary(report))
        return report

    def _serve_wheels(self, hp: HostPlan, seed: relay.Seed, files: list[tuple[Path, str]], port: int) -> None:
        """The seed: serve uv and the wheels (paths below WORKDIR/.cache) to the other hosts of
        the cluster on a planned (free) TF port, from a second SSH session, until no request
        comes for a while."""
        if not any(other.managed for other in self.plan.hosts if other.name != hp.name):
            return
        argv = [hp.base_python, hp.launcher, "serve-wheels", "--dir", layout.cache_dir(hp.spec.workdir),
                "--port", str(port), "--idle", f"{relay.SERVE_IDLE:g}", "--limit", f"{relay.SERVE_LIMIT:g}",
                *[a for _, rel in files for a in ("--file", rel)]]

        def serve() -> None:
            try:
                with self.transport(hp) as t2:
                    t2.run(argv, timeout=relay.SERVE_LIMIT + 30)
            except HostError:
                pass  # the other hosts fall back to this machine
            finally:
                seed.closed.set()

        seed.url = f"http://{hp.tasks[0].addr_host}:{port}"
        seed.thread = threading.Thread(target=serve, name=f"dtf-wheels-{hp.name}", daemon=True)
        seed.thread.start()

    def _copy_wheels(self, t: Transport, hp: HostPlan, seed: relay.Seed,
                     need: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
        """Copy what this host needs (uv, wheels) from the seed host (hosts reach each other on
        the TF ports); what could not be copied is left for this machine to send."""
        self._step(hp, f"waiting for {seed.host} to receive the wheels")
        deadline = time.monotonic() + relay.SEED_WAIT
        while not seed.ready.wait(0.2):
            if self.cancel.is_set():
                raise Cancelled("interrupted")
            if time.monotonic() > deadline:
                return need
        if seed.url is None or seed.closed.is_set():
            return need
        self._step(hp, f"copying {len(need)} files from {seed.host}")
        digests = self.wheels.sha256([f for f, _ in need])
        argv = [hp.base_python, hp.launcher, "fetch-wheels", "--from", seed.url,
                "--dir", layout.cache_dir(hp.spec.workdir),
                *[a for f, rel in need for a in ("--file", f"{rel}:{digests[f]}")]]
        try:
            reply = self._decode(FetchReply, t.run(argv, timeout=relay.SERVE_LIMIT), "copying the wheels")
        except HostError as e:
            self.progress(hp.name, f"copying from {seed.host} failed ({e}): sending from here")
            return need
        if reply.error:
            self.progress(hp.name, f"{reply.error}: sending the rest from here")
        fetched = set(reply.fetched)
        self.copied[hp.name] = sum(f.stat().st_size for f, rel in need if rel in fetched)
        return [(f, rel) for f, rel in need if rel not in fetched]

    def _send(self, t: Transport, hp: HostPlan, local: Path, remote: str) -> None:
        try:
            t.put_file(local, posixpath.dirname(remote), posixpath.basename(remote))
        except HostError as e:
            # SFTP says only "Failure" when the disk is full: ask the host what is left.
            free = t.run([hp.base_python, "-c", "import os,sys;s=os.statvfs(sys.argv[1]);"
                          "print(s.f_bavail*s.f_frsize)", posixpath.dirname(remote)], timeout=30)
            if free.ok and free.stdout.strip().isdigit() and int(free.stdout) < local.stat().st_size:
                raise HostError(f"disk full while sending the wheels to {posixpath.dirname(remote)} "
                                f"({_mb(int(free.stdout))} free)")
            raise e

    def _fence(self, t: Transport, hp: HostPlan, client_address: str | None) -> None:
        """`firewall: members`: close the host's TF ports to all but the cluster's hosts (and the
        laptop, in direct mode) before any server listens."""
        self._step(hp, "closing the TF ports to non-members")
        allow = self.plan.members()
        if self.plan.network_for(hp) == "direct" and client_address:
            allow.append(client_address)
        fenced = self._decode(FenceReply, t.run(hp.fence_argv(allow), timeout=60), "setting firewall rules")
        if fenced.error:
            raise HostError(f"firewall: members is not possible there: {fenced.error}")

    def _reachable(self, t: Transport, hp: HostPlan, tasks: Sequence[TaskPlan]) -> bool:
        """Check that this machine reaches every task as the plan's network says; whether the
        TF ports accept connections from here directly (also in ssh mode: `up` reports it)."""
        network = self.plan.network_for(hp)
        if network == "direct":
            deadline = time.monotonic() + REACH_TIMEOUT
            for task in tasks:
                if not wait_port(task.addr_host, task.port, deadline):
                    raise HostError(f"{task.name} serves on its host but {task.address} is not "
                                    f"reachable from this machine (firewall? wrong address? try network: ssh)")
            return True
        direct = all(_probe_all(lambda task: port_open(task.addr_host, task.port, DIRECT_PROBE), tasks))
        if direct and network == "auto":
            return True
        deadline = time.monotonic() + REACH_TIMEOUT
        for task in tasks:
            while not t.reaches(task.address, timeout=min(5.0, REACH_TIMEOUT)):
                if time.monotonic() > deadline:
                    raise HostError(f"{task.name} serves on its host but {task.address} is not reachable "
                                    f"through SSH from this machine (does its sshd allow TCP forwarding?)"
                                    + ("" if network == "ssh" else ", nor directly"))
                time.sleep(0.2)
        return direct

    def check_mesh(self, timeout: float = MESH_TIMEOUT) -> dict[str, Outcome[None]]:
        """From each host, open a connection to every task of the other hosts: each task reaches
        every other at its planned address (FACTS.md), or training hangs. HostError names the pairs."""
        def one(hp: HostPlan) -> None:
            others = {t.address: t for t in self.plan.tasks() if t.host != hp.name}
            if not others:
                return
            self._step(hp, "checking it reaches the other hosts' tasks")
            with self.transport(hp) as t:
                reply = self._ask(t, hp, ReachReply, hp.reach_argv(list(others), timeout),
                                  "checking the other hosts' TF ports", timeout + 30)
            if reply.unreachable:
                raise HostError("; ".join(f"cannot reach {others[a].name} at {a} (on {others[a].host}): {why}"
                                          for a, why in reply.unreachable.items()))

        return self.each_host(one)

    def up(self, only: dict[str, set[str]] | None = None) -> dict[str, Outcome[HostStarted]]:
        """Start every task, or only the tasks named per host in `only`."""
        version = local_tf_version()
        if only is None:
            return self.each_host(lambda hp: self.start_host(hp, version))
        return self.each_host(lambda hp: self.start_host(hp, version, only[hp.name]), self._hosts_in(only))

    def unreachable(self, network: str, timeout: float, names: Collection[str] | None = None) -> list[TaskPlan]:
        """The tasks (all, or those named) this machine cannot open a connection to: directly, or
        (network ssh) through their host's SSH; every task of a host probed in parallel. Local
        hosts' tasks are probed directly."""
        def through(hp: HostPlan) -> list[TaskPlan]:
            tasks = hp.tasks_in(names)
            if network != "ssh" or hp not in self.plan.remote_hosts:
                return [task for task, ok in zip(tasks, _probe_all(
                    lambda task: port_open(task.addr_host, task.port, timeout), tasks)) if not ok]
            with self.transport(hp) as t:
                return [task for task, ok in zip(tasks, _probe_all(
                    lambda task: t.reaches(task.address, timeout), tasks)) if not ok]

        hosts = [hp for hp in self.plan.hosts if hp.tasks_in(names)]
        outcomes = self.each_host(through, hosts)
        lost = {task.name for hp in hosts for task in (
            outcomes[hp.name].value if outcomes[hp.name].ok else hp.tasks_in(names))}
        return [task for task in self.plan.tasks() if task.name in lost]

    # -- sync ----------------------------------------------------------------------------------
    def sync_host(self, hp: HostPlan, packs: Sequence[sync.Pack]) -> sync.HostSynced:
        """Make sure the host holds every pack below WORKDIR/.cache/sync: one check each, and the
        bytes (streamed to the launcher, which checks their hash) only where one is missing."""
        sent: dict[str, int] = {}
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            for p in packs:
                self._step(hp, f"checking {p.name} ({p.synced.short})")
                have = self._ask(t, hp, SyncReply, hp.sync_argv(p.digest), f"checking {p.name}", 30)
                if have.present:
                    sent[p.name] = 0
                    continue
                self._step(hp, f"sending {p.name}: {sync.megabytes(p.bytes)}")
                meter = sync.Meter(lambda step: self._step(hp, step), p.name, p.bytes)
                try:
                    with p.open() as f:
                        result = t.feed(hp.sync_argv(p.digest, receive=True), f, sent=meter)
                except sync.SyncError as e:  # a file vanished or shrank since it was hashed
                    raise HostError(f"sending {p.name}: {e}")
                reply = self._decode(SyncReply, result, f"sending {p.name}")
                if not reply.present:
                    raise HostError(f"sending {p.name}: the host did not keep it")
                sent[p.name] = reply.received
        return sync.HostSynced(sent)

    # -- the lease -----------------------------------------------------------------------------
    def renew_host(self, hp: HostPlan, ttl: float | None = None) -> RenewReply:
        with self.transport(hp) as t:
            try:
                return self._ask(t, hp, RenewReply, hp.renew_argv(ttl), "renewing the lease", RENEW_TIMEOUT,
                                 upload_if=lambda: self._root_exists(t, hp))
            except LauncherMissing:
                return RenewReply(lease=None)  # the files are gone: nothing to renew

    def renew(self, ttl: float | None = None) -> dict[str, Outcome[RenewReply]]:
        return self.each_host(lambda hp: self.renew_host(hp, ttl))

    # -- status --------------------------------------------------------------------------------
    def status_host(self, hp: HostPlan) -> StatusReply:
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            try:
                return self._ask(t, hp, StatusReply, hp.status_argv(), "status", 30,
                                 upload_if=lambda: self._root_exists(t, hp))
            except LauncherMissing:
                # dtf's files are gone: the lease lapsed and the tasks cleaned up after
                # themselves, or the host was wiped. Every task is dead.
                gone = TaskStatus.dead(FILES_GONE.format(root=hp.root))
                return StatusReply(tasks={task.name: gone for task in hp.tasks}, lease=None)

    def status(self) -> dict[str, Outcome[StatusReply]]:
        return self.each_host(self.status_host)

    def task_states(self) -> list[TaskState]:
        return task_states(self.plan, self.status())

    # -- down ----------------------------------------------------------------------------------
    def stop_host(self, hp: HostPlan, keep_logs: bool = False, grace: float = STOP_GRACE,
                  only: Collection[str] | None = None, purge: bool = False) -> HostStopped:
        """Stop the host's tasks and remove dtf's files; with `only`, stop just those tasks; with
        `purge`, remove WORKDIR/.cache too (managed environments, wheels, synced trees)."""
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            self._step(hp, "stopping servers")
            stopped = self._ask(t, hp, StopReply, hp.stop_argv(grace, only), "stopping servers", grace + 30)
            left = [n for n, s in stopped.tasks.items() if not s.gone]
            if left:
                raise HostError(f"still running after KILL: {', '.join(left)}")
            if only is not None:
                return HostStopped(stopped.tasks)
            purged = None
            if purge:  # before `clean`, which removes the launcher
                self._step(hp, f"removing {hp.spec.workdir}/.cache")
                argv = hp.purge_argv()
                purged = self._ask(t, hp, PurgeReply, argv, "purging the cache", 300)
            self._step(hp, "removing files")
            cleaned = self._ask(t, hp, CleanReply, hp.clean_argv(keep_logs), "cleaning up", 30)
        return HostStopped(stopped.tasks, cleaned.removed, purged)

    def down(self, keep_logs: bool = False, grace: float = STOP_GRACE,
             hosts: Sequence[HostPlan] | None = None, purge: bool = False) -> dict[str, Outcome[HostStopped]]:
        return self.each_host(lambda hp: self.stop_host(hp, keep_logs, grace, purge=purge), hosts)

    def remove_launcher(self, hosts: Sequence[HostPlan]) -> dict[str, Outcome[CleanReply]]:
        """Undo an upload that no start followed: remove dtf's files unless tasks (another
        dtf's) run there."""
        def clean(hp: HostPlan) -> CleanReply:
            with self.transport(hp) as t:
                return self._ask(t, hp, CleanReply, hp.clean_argv(False, if_unused=True), "cleaning up", 30)

        return self.each_host(clean, hosts)

    def stop_tasks(self, only: dict[str, set[str]], grace: float = STOP_GRACE) -> dict[str, Outcome[HostStopped]]:
        """Stop the tasks named per host (a partial rollback); leave the rest and the files."""
        return self.each_host(lambda hp: self.stop_host(hp, grace=grace, only=only[hp.name]),
                              self._hosts_in(only))


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def env_summary(report: EnvReport) -> str:
    """`built in 41.2s (resolve 2.0s, send 6.1s, create 0.1s, install 33.0s), 1.5 GB`."""
    if report.reused and not report.seconds:
        return "reused (found complete by the check)"
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
    what = "found complete" if report.reused else "built"
    size = f", {_mb(report.size)} on disk" if report.size else ""
    sent = f", {_mb(report.sent)} sent" if report.sent else ""
    copied = f", {_mb(report.copied)} copied from another host" if report.copied else ""
    return f"{what} in {sum(report.seconds.values()):.1f}s ({phases}){size}{sent}{copied}"


class LeaseKeeper:
    """Renews the cluster's lease on every host while a long command (`dtf train`) runs.

    A renewal that fails (a host cut off) is retried at the next beat; `warn` is told once per
    host when its lease has gone unrenewed for half its ttl, since the tasks there will stop
    themselves when it lapses.
    """

    def __init__(self, plan: Plan, warn: Callable[[str], None], connect_timeout: float = CONNECT_TIMEOUT):
        self.ops = ClusterOps(plan, connect_timeout=connect_timeout)
        self.ttl = min((hp.ttl for hp in plan.hosts), default=0.0)
        self.interval = min(max(self.ttl / 4, 1.0), 60.0)
        self.warn = warn
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dtf-lease", daemon=True)
        self.renewed = {hp.name: time.monotonic() for hp in plan.hosts}
        self.warned: set[str] = set()

    def __enter__(self) -> LeaseKeeper:
        if self.ttl > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=RENEW_TIMEOUT + self.ops.connect_timeout)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            for host, o in self.ops.renew().items():
                now = time.monotonic()
                if o.ok and o.value.lease is not None:
                    self.renewed[host] = now
                    self.warned.discard(host)
                elif now - self.renewed[host] > self.ttl / 2 and host not in self.warned:
                    self.warned.add(host)
                    why = "its tasks' files are gone" if o.ok else o.reason
                    self.warn(f"cannot renew the lease on {host} for {now - self.renewed[host]:.0f}s "
                              f"({why}); its tasks stop themselves if it lapses ({self.ttl:g}s)")
