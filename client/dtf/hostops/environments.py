"""Managed environments (`python: managed`) on the hosts `up` starts: reused when the host's check
found one complete, else resolved and fetched on this machine (the wheel cache), sent (or copied
from another host of the cluster, a tree of hosts with a few children each: dtf.files.relay) and
built there."""

from __future__ import annotations

import posixpath
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dtf.cluster.plan import HostPlan
from dtf.files import environment, relay
from dtf.hostops.launcher import decode
from dtf.hostops.parallel import Cancelled, HostOps
from dtf.hosts.base import CommandRunner, HostError
from dtf.hosts.mux import SSH_FAILED
from dtf.hosts.programs import script
from dtf_server.protocol import CheckReply, EnvReply, FetchReply, FetchWheelsRequest, Layout, ServeWheelsRequest

ENV_BUILD_TIMEOUT = 1800.0  # seconds a managed environment's build may take on a host
# A managed environment takes several times its wheels on disk once installed (tensorflow-cpu's
# wheels unpack and compile); `up` refuses a host with less free space than wheels + this.
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


class Environments:
    """The managed environments of one `up`: the laptop's wheel cache, shared by its hosts, and
    the relay that lets one host serve the wheels to the others."""

    def __init__(self, ops: HostOps) -> None:
        self.ops = ops
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

    def build(self, t: CommandRunner, hp: HostPlan, check: CheckReply, free_port: int) -> EnvReport:
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
            raise HostError(f"disk full: {mb(check.free)} free for {hp.env_dir}, a managed environment "
                            f"needs about {mb(ENV_MIN_FREE)} or more")
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        self.ops.step(hp, f"resolving and fetching packages for {target.tag} / python {target.py}")
        try:
            wheels = self.wheels.wheels(hp.requirements, hp.spec.accelerator, target)
            uv = self.wheels.uv_for(target)
        except environment.EnvError as e:
            raise HostError(str(e))
        seconds["resolve"] = time.monotonic() - t0
        missing = [f for f in wheels.files if f.name not in set(check.wheels)]
        space = sum(f.stat().st_size for f in missing) + int(wheels.size * ENV_SIZE_FACTOR)
        if 0 <= check.free < space:
            raise HostError(f"disk full: {mb(check.free)} free for {hp.env_dir}, the environment needs "
                            f"about {mb(space)}")
        t0 = time.monotonic()
        # What this host lacks, as (file here, path below WORKDIR/.cache there): uv, and wheels.
        cache = Layout.cache_dir(hp.spec.workdir)
        uv_rel = f"bin/{environment.uv_name(uv)}"
        remote_uv = posixpath.join(cache, uv_rel)
        need = [] if t.run(["test", "-x", remote_uv], timeout=30).ok else [(uv, uv_rel)]
        need += [(f, f"wheels/{f.name}") for f in missing]
        sent = 0
        seed = None  # this host's place in the target's tree: it copies from its parent, serves its children
        if need:
            seed = self.relay.join(target.key, hp.name)
        try:
            if seed is not None and seed.parent is not None:
                need = self._copy_wheels(t, hp, seed.parent, need)
            total = sum(f.stat().st_size for f, _ in need)
            for i, (f, rel) in enumerate(need, 1):
                self.ops.step(hp, f"sending {i}/{len(need)}: {f.name} ({mb(sent)} of {mb(total)})")
                self._send(t, hp, f, posixpath.join(cache, rel))
                sent += f.stat().st_size
            if seed is not None:
                self._serve_wheels(hp, seed, [(uv, uv_rel),
                                              *[(f, f"wheels/{f.name}") for f in wheels.files]], free_port)
        finally:
            if seed is not None:
                seed.ready.set()  # serving, or failed: its children stop waiting either way
        if not t.run(["chmod", "755", remote_uv], timeout=30).ok:
            raise HostError(f"cannot make {remote_uv} executable")
        requirements = f"{hp.env_dir}.requirements.txt"
        t.put_bytes(wheels.text().encode(), posixpath.dirname(requirements), posixpath.basename(requirements))
        seconds["send"] = time.monotonic() - t0
        self.ops.step(hp, f"building the environment ({len(wheels.pinned)} packages)")
        try:
            r = t.run(hp.env_argv(remote_uv, requirements), timeout=ENV_BUILD_TIMEOUT)
        finally:
            if seed is not None and seed.thread is not None:
                # Its servers need the port; and whatever happens here, the others may be copying.
                self.ops.step(hp, "waiting for the other hosts to finish copying the wheels from here")
                seed.thread.join(timeout=relay.SERVE_LIMIT + 60)
        try:
            built = decode(EnvReply, r, "building the environment")
        except HostError:
            if r.stdout.strip() or 0 <= r.exit_code < SSH_FAILED:
                raise
            # No reply and killed by a signal: what was built is never used. ssh says so as -1
            # (paramiko), -9 (our ssh client killed with it), or 255 (the remote command ended by
            # a signal has no exit status; a lost connection was already reported as such).
            raise HostError(f"the environment build in {hp.env_dir} was killed before it finished; "
                            f"the next `dtf up` builds it again")
        if not built.ok:
            raise HostError(built.error or "building the environment failed")
        seconds.update(built.seconds)
        report = EnvReport(dir=hp.env_dir, reused=built.reused, seconds=seconds, size=built.size, sent=sent,
                           copied=self.copied.get(hp.name, 0))
        self.ops.step(hp, "environment ready: " + env_summary(report))
        return report

    def _serve_wheels(self, hp: HostPlan, seed: relay.Seed, files: list[tuple[Path, str]], port: int) -> None:
        """A host of the tree that has the wheels: serve uv and the wheels (paths below
        WORKDIR/.cache) to the hosts that copy from it on a planned (free) TF port, from a second
        SSH session, until no request comes for a while."""
        if not any(other.managed for other in self.ops.plan.hosts if other.name != hp.name):
            return
        argv = hp.base_launcher_argv(ServeWheelsRequest(dir=Layout.cache_dir(hp.spec.workdir), port=port,
                                                        idle=relay.SERVE_IDLE, limit=relay.SERVE_LIMIT,
                                                        file=[rel for _, rel in files]))

        def serve() -> None:
            try:
                with self.ops.runner(hp) as t2:
                    t2.run(argv, timeout=relay.SERVE_LIMIT + 30)
            except HostError:
                pass  # the other hosts fall back to this machine
            finally:
                seed.closed.set()

        seed.url = f"http://{hp.tasks[0].addr_host}:{port}"
        seed.thread = threading.Thread(target=serve, name=f"dtf-wheels-{hp.name}", daemon=True)
        seed.thread.start()

    def _copy_wheels(self, t: CommandRunner, hp: HostPlan, seed: relay.Seed,
                     need: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
        """Copy what this host needs (uv, wheels) from its parent in the tree, `seed` (hosts reach
        each other on the TF ports); what could not be copied is left for this machine to send."""
        self.ops.step(hp, f"waiting for {seed.host} to receive the wheels")
        deadline = time.monotonic() + relay.SEED_WAIT
        while not seed.ready.wait(0.2):
            if self.ops.cancel.is_set():
                raise Cancelled("interrupted")
            if time.monotonic() > deadline:
                return need
        if seed.url is None or seed.closed.is_set():
            return need
        self.ops.step(hp, f"copying {len(need)} files from {seed.host}")
        digests = self.wheels.sha256([f for f, _ in need])
        argv = hp.base_launcher_argv(FetchWheelsRequest(source=seed.url, dir=Layout.cache_dir(hp.spec.workdir),
                                                        file=[f"{rel}:{digests[f]}" for f, rel in need]))
        try:
            reply = decode(FetchReply, t.run(argv, timeout=relay.SERVE_LIMIT), "copying the wheels")
        except HostError as e:
            self.ops.progress(hp.name, f"copying from {seed.host} failed ({e}): sending from here")
            return need
        if reply.error:
            self.ops.progress(hp.name, f"{reply.error}: sending the rest from here")
        fetched = set(reply.fetched)
        self.copied[hp.name] = sum(f.stat().st_size for f, rel in need if rel in fetched)
        return [(f, rel) for f, rel in need if rel not in fetched]

    def _send(self, t: CommandRunner, hp: HostPlan, local: Path, remote: str) -> None:
        try:
            t.put_file(local, posixpath.dirname(remote), posixpath.basename(remote))
        except HostError as e:
            # SFTP says only "Failure" when the disk is full: ask the host what is left.
            free = t.run([hp.base_python, "-c", script("free_bytes.py"), posixpath.dirname(remote)], timeout=30)
            if free.ok and free.stdout.strip().isdigit() and int(free.stdout) < local.stat().st_size:
                raise HostError(f"disk full while sending the wheels to {posixpath.dirname(remote)} "
                                f"({mb(int(free.stdout))} free)")
            raise e


def mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def env_summary(report: EnvReport) -> str:
    """`built in SECONDS (resolve SECONDS, send SECONDS, create SECONDS, install SECONDS), SIZE`."""
    if report.reused and not report.seconds:
        return "reused (found complete by the check)"
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
    what = "found complete" if report.reused else "built"
    size = f", {mb(report.size)} on disk" if report.size else ""
    sent = f", {mb(report.sent)} sent" if report.sent else ""
    copied = f", {mb(report.copied)} copied from another host" if report.copied else ""
    return f"{what} in {sum(report.seconds.values()):.1f}s ({phases}){size}{sent}{copied}"
