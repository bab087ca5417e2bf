"""Acting on a plan: start, inspect and stop the servers of every host, all hosts in parallel.

Each host gets one thread, its own connection and a deadline on every step; the result is one
outcome per host (Fabric's GroupResult habit) and one combined HostFailure listing every host that
failed. Nothing here prints: progress goes through a callback, so the CLI decides how it looks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from dtf.netutil import wait_port
from dtf.plan import HostPlan, Plan
from dtf.transport import CONNECT_TIMEOUT, HostError, Transport, transport_for

Progress = Callable[[str, str], None]  # (host, what it is doing now)
STOP_GRACE = 10.0
RENEW_TIMEOUT = 15.0
REACH_TIMEOUT = 15.0  # seconds the laptop gives a started server's port to accept a connection


def launcher_text() -> str:
    return resources.files("dtf_server").joinpath("launcher.py").read_text()


def local_tf_version() -> str | None:
    """The laptop's TensorFlow version, asked the same way the launcher asks on each host
    (package metadata: importing TensorFlow takes seconds)."""
    from dtf_server.launcher import tf_version

    return tf_version()


@dataclass
class Outcome:
    host: str
    ok: bool
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Cancelled(Exception):
    pass


def _no_progress(host: str, step: str) -> None:
    pass


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

    def transport(self, hp: HostPlan) -> Transport:
        return transport_for(hp.spec, self.plan.ssh_config, self.connect_timeout)

    def each_host(self, fn: Callable[[HostPlan], dict], hosts: tuple[HostPlan, ...] | None = None
                  ) -> dict[str, Outcome]:
        """Run fn on every host in parallel; an exception on one host is that host's outcome."""
        hosts = self.plan.hosts if hosts is None else hosts

        def one(hp: HostPlan) -> Outcome:
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

    @staticmethod
    def _launcher_gone(result: Any) -> bool:
        """The command failed because launcher.py is not there (dtf's files were removed)."""
        return not result.ok and "launcher.py" in result.stderr and "No such file" in result.stderr

    def _hosts_in(self, only: dict[str, set[str]]) -> tuple[HostPlan, ...]:
        return tuple(hp for hp in self.plan.hosts if only.get(hp.name))

    @staticmethod
    def _json(result: Any, what: str) -> dict:
        try:
            return json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            err = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise HostError(f"{what} failed (exit {result.exit_code}): {err}")

    def _upload(self, t: Transport, hp: HostPlan) -> None:
        t.put_text(launcher_text(), hp.root, "launcher.py")

    # -- up ------------------------------------------------------------------------------------
    def start_host(self, hp: HostPlan, tf_version: str | None, only: Collection[str] | None = None) -> dict:
        """Start the host's tasks (or those named in `only`: the others keep running)."""
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            self._step(hp, "uploading launcher")
            self.touched.add(hp.name)  # from here on, a rollback must remove what we put there
            self._upload(t, hp)
            self._step(hp, "checking python and TensorFlow")
            r = t.run(hp.check_argv(only), timeout=30)
            if r.exit_code in (126, 127):  # the shell's "not found" / "not executable"
                raise HostError(f"python missing: {hp.python!r} cannot be run there")
            check = self._json(r, f"{hp.python} (the host's python)")
            remote_tf = check.get("tensorflow")
            if remote_tf is None:
                raise HostError(f"TensorFlow is not installed for {hp.python} "
                                f"(install tensorflow-cpu=={tf_version} there)")
            if tf_version and remote_tf != tf_version:
                raise HostError(f"TensorFlow mismatch: {remote_tf} on the host ({hp.python}), "
                                f"{tf_version} on this machine")
            if check.get("running") and only is None:
                raise HostError(
                    f"cluster {self.plan.cluster!r} already runs here ({', '.join(check['running'])} "
                    f"in {hp.root}), started by another dtf (another DTF_HOME or machine): "
                    f"`dtf down` it there, or name this cluster differently")
            if check["busy"]:
                raise HostError("port busy: " + ", ".join(
                    f"{task.port} ({task.name})" for task in hp.tasks if task.port in check["busy"]))
            tasks = hp.tasks_in(only)
            self._step(hp, f"starting {len(tasks)} server(s)")
            self.started.add(hp.name)  # from here on, a rollback must stop tasks there
            r = t.run(hp.start_argv_for(only), timeout=hp.start_timeout + 30)
            started = self._json(r, "starting servers")["tasks"]
        pids = {name: s["pid"] for name, s in started.items()}
        failed = {n: s for n, s in started.items() if not s["ok"]}
        if failed:
            name, s = next(iter(failed.items()))
            log = " | ".join(line.strip() for line in s.get("log_tail", [])[-5:] if line.strip())
            raise HostError(f"server crashed: {name}: {s['reason']}" + (f"; log: {log}" if log else ""))
        self._step(hp, "checking the servers are reachable from here")
        deadline = time.monotonic() + REACH_TIMEOUT
        for task in tasks:
            if not wait_port(task.addr_host, task.port, deadline):
                raise HostError(f"{task.name} serves on its host but {task.address} is not "
                                f"reachable from this machine (firewall? wrong address?)")
        return {"pids": pids, "client_address": check.get("client_address")}

    def up(self, only: dict[str, set[str]] | None = None) -> dict[str, Outcome]:
        """Start every task, or only the tasks named per host in `only`."""
        version = local_tf_version()
        if only is None:
            return self.each_host(lambda hp: self.start_host(hp, version))
        return self.each_host(lambda hp: self.start_host(hp, version, only[hp.name]), self._hosts_in(only))

    # -- the lease -----------------------------------------------------------------------------
    def renew_host(self, hp: HostPlan, ttl: float | None = None) -> dict:
        with self.transport(hp) as t:
            r = t.run(hp.renew_argv(ttl), timeout=RENEW_TIMEOUT)
            if self._launcher_gone(r):
                return {"gone": True}
            return self._json(r, "renewing the lease")

    def renew(self, ttl: float | None = None) -> dict[str, Outcome]:
        return self.each_host(lambda hp: self.renew_host(hp, ttl))

    # -- status --------------------------------------------------------------------------------
    def status_host(self, hp: HostPlan) -> dict:
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            r = t.run(hp.status_argv(), timeout=30)
            if self._launcher_gone(r):
                # dtf's files are gone: the lease lapsed and the tasks cleaned up after
                # themselves, or the host was wiped. Every task is dead.
                reason = f"dtf's files are gone from {hp.root} (lease lapsed?)"
                return {"tasks": {task.name: {"alive": False, "state": "gone", "pid": None,
                                              "uptime": None, "reason": reason} for task in hp.tasks}}
            return self._json(r, "status")

    def status(self) -> dict[str, Outcome]:
        return self.each_host(self.status_host)

    # -- down ----------------------------------------------------------------------------------
    def stop_host(self, hp: HostPlan, keep_logs: bool = False, grace: float = STOP_GRACE,
                  only: Collection[str] | None = None) -> dict:
        """Stop the host's tasks and remove dtf's files; with `only`, stop just those tasks."""
        self._step(hp, "connecting")
        with self.transport(hp) as t:
            self._upload(t, hp)  # it may have been removed: stopping must not depend on it
            self._step(hp, "stopping servers")
            r = t.run(hp.stop_argv(grace, only), timeout=grace + 30)
            stopped = self._json(r, "stopping servers")["tasks"]
            left = [n for n, s in stopped.items() if not s.get("gone", True)]
            if left:
                raise HostError(f"still running after KILL: {', '.join(left)}")
            if only is not None:
                return {"stopped": stopped, "removed": []}
            self._step(hp, "removing files")
            r = t.run(hp.clean_argv(keep_logs), timeout=30)
            cleaned = self._json(r, "cleaning up")
        return {"stopped": stopped, "removed": cleaned.get("removed", [])}

    def down(self, keep_logs: bool = False, grace: float = STOP_GRACE,
             hosts: tuple[HostPlan, ...] | None = None) -> dict[str, Outcome]:
        return self.each_host(lambda hp: self.stop_host(hp, keep_logs, grace), hosts)

    def remove_launcher(self, hosts: tuple[HostPlan, ...]) -> dict[str, Outcome]:
        """Undo an upload that no start followed: remove dtf's files unless tasks (another
        dtf's) run there."""
        def clean(hp: HostPlan) -> dict:
            with self.transport(hp) as t:
                return self._json(t.run(hp.clean_argv(False, if_unused=True), timeout=30), "cleaning up")

        return self.each_host(clean, hosts)

    def stop_tasks(self, only: dict[str, set[str]], grace: float = STOP_GRACE) -> dict[str, Outcome]:
        """Stop the tasks named per host (a partial rollback); leave the rest and the files."""
        return self.each_host(lambda hp: self.stop_host(hp, grace=grace, only=only[hp.name]),
                              self._hosts_in(only))


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
                if o.ok and not o.data.get("gone"):
                    self.renewed[host] = now
                    self.warned.discard(host)
                elif now - self.renewed[host] > self.ttl / 2 and host not in self.warned:
                    self.warned.add(host)
                    why = "its tasks' files are gone" if o.ok else o.reason
                    self.warn(f"cannot renew the lease on {host} for {now - self.renewed[host]:.0f}s "
                              f"({why}); its tasks stop themselves if it lapses ({self.ttl:g}s)")
