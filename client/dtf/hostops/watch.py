"""`dtf top`'s feed: one connection per host for the view's whole life, and on it one launcher
`top` command that prints a sample of every task of the host each interval (dtf_server.sample).
A refresh costs no SSH handshake and no round trip: the hosts push. A host that says nothing for
STALL intervals is shown as such, and its connection made again (a new handshake only then).

`dtf train`'s repair (dtf.hostops.repair) reads a Watch too, of states only (`top --states-only`:
no /proc scan on the hosts), and has it `follow` a new plan when tasks move to a spare.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dtf.cluster.plan import HostPlan
from dtf.hostops import launcher
from dtf.hostops.parallel import HostOps
from dtf.hosts.base import CommandRunner, HostError, LineStream
from dtf_server import protocol
from dtf_server.protocol import ProtocolMismatch, StatusReply, StatusRequest, TopRequest, TopSample

STALL = 5  # intervals without a sample before a host is "silent" and its connection made again
RETRY = 3.0  # seconds before connecting again to a host that failed


class FilesGone(HostError):
    """dtf's files are gone from a host: taken down, or its lease lapsed (every task is dead)."""


@dataclass(frozen=True)
class HostFeed:
    """The latest of one host: its sample (None: none yet), or why there is none now."""

    sample: TopSample | None = None
    error: str | None = None
    samples: int = 0  # samples received since the view started
    connects: int = 0  # connections opened to the host (1 while all is well)
    at: float | None = None  # time.monotonic() here when the latest sample came
    files_gone: bool = False  # dtf's files are gone from the host (every task is dead)


class Watch:
    """Start with `with Watch(ops, interval) as w:`; `w.feeds()` is the latest of every host."""

    def __init__(self, ops: HostOps, interval: float = 1.0, states_only: bool = False) -> None:
        self.ops, self.interval, self.states_only = ops, interval, states_only
        self._feeds: dict[str, HostFeed] = {hp.name: HostFeed() for hp in ops.plan.hosts}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._left: dict[str, threading.Event] = {}  # host -> set when the watch no longer follows it
        self._threads: list[threading.Thread] = []
        self.changed = threading.Event()  # set at every new sample or error

    def feeds(self) -> dict[str, HostFeed]:
        with self._lock:
            return dict(self._feeds)

    def _set(self, host: str, **changes: object) -> None:
        with self._lock:
            if host not in self._feeds:
                return  # no longer followed
            self._feeds[host] = HostFeed(**{**self._feeds[host].__dict__, **changes})
        self.changed.set()

    def follow(self, ops: HostOps) -> None:
        """Follow the hosts of `ops.plan` from now on (tasks moved to a spare): a host new to the
        watch gets its connection, one left out has its connection closed and its feed dropped;
        the others go on as they were."""
        with self._lock:
            old = {hp.name for hp in self.ops.plan.hosts}
            self.ops = ops
            new = [hp for hp in ops.plan.hosts if hp.name not in old]
            for name in old - {hp.name for hp in ops.plan.hosts}:
                self._feeds.pop(name, None)
                if name in self._left:
                    self._left[name].set()
            for hp in new:
                self._feeds[hp.name] = HostFeed()
            started = bool(self._threads)
        if started:
            for hp in new:
                self._start(hp)

    def _start(self, hp: HostPlan) -> None:
        left = self._left[hp.name] = threading.Event()
        th = threading.Thread(target=self._host, args=(hp, left), daemon=True, name=f"dtf-top-{hp.name}")
        th.start()
        self._threads.append(th)

    def wait_samples(self, count: int, timeout: float) -> None:
        """Until every host has sent `count` samples or failed, or `timeout` seconds passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            feeds = self.feeds().values()
            if all(f.samples >= count or (f.error is not None and f.samples == 0) for f in feeds):
                return
            self.changed.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            self.changed.clear()

    def _host(self, hp: HostPlan, left: threading.Event) -> None:
        while not self._stop.is_set() and not left.is_set():
            try:
                self._follow(hp, left)
            except FilesGone as e:
                self._set(hp.name, error=str(e), files_gone=True, at=time.monotonic())
            except (HostError, ProtocolMismatch, ValueError) as e:
                self._set(hp.name, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            except NotImplementedError:
                self._set(hp.name, error="dtf top cannot follow this kind of host yet")
                return
            self._stop.wait(RETRY)

    def _follow(self, hp: HostPlan, left: threading.Event) -> None:
        with self._lock:
            if hp.name not in self._feeds:
                return
            connects = self._feeds[hp.name].connects + 1
        self._set(hp.name, connects=connects)
        runner = self.ops.runner(hp)
        with runner:
            self._ensure_launcher(runner, hp)
            stream = runner.lines(hp.launcher_argv(TopRequest(dir=hp.root, interval=self.interval,
                                                                 states_only=self.states_only, task=hp.task_names())))
            try:
                self._read(hp, stream, left)
            finally:
                stream.close()

    def _ensure_launcher(self, t: CommandRunner, hp: HostPlan) -> None:
        """One status over the new connection: ships this dtf's launcher if it is not there."""
        try:
            launcher.ask(t, hp, StatusReply, hp.launcher_argv(StatusRequest(dir=hp.root, task=hp.task_names())),
                         "status", launcher.RENEW_TIMEOUT, upload_if=lambda: launcher.root_exists(t, hp))
        except launcher.LauncherMissing:
            raise FilesGone(f"dtf's files are gone from {hp.root} (taken down, or its lease lapsed)")

    def _read(self, hp: HostPlan, stream: LineStream, left: threading.Event) -> None:
        silent_for = STALL * self.interval + 5
        heard = time.monotonic()
        while not self._stop.is_set() and not left.is_set():
            line = stream.readline(timeout=0.5)
            if line is None:
                if time.monotonic() - heard > silent_for:
                    raise HostError(f"no word from {hp.name} for {silent_for:.0f}s")
                continue
            if not line.strip():
                continue
            sample = protocol.decode(TopSample, line)
            heard = time.monotonic()
            with self._lock:
                count = self._feeds[hp.name].samples + 1
            self._set(hp.name, sample=sample, error=None, samples=count, at=heard, files_gone=False)

    def __enter__(self) -> Watch:
        with self._lock:
            hosts = list(self.ops.plan.hosts)
        for hp in hosts:
            self._start(hp)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        deadline = time.monotonic() + 2  # each notices within half a second; one stuck in a connect
        for th in self._threads:        # is a daemon thread: it does not hold up the exit
            th.join(timeout=max(0.0, deadline - time.monotonic()))
