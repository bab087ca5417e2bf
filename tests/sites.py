"""Where a fake-server test's cluster runs: local processes, or the SSH lab's hosts.

A test names hosts "a" and "b" and asks the site for everything that differs between the two:
the inventory, the hosts' names as dtf reports them, their files and processes, a port held busy
on one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import yaml

from dtf.hosts.netutil import listen_ports
from helpers import dtf
from lab import Lab

CLUSTER = "fk"
FAKE = {"DTF_SERVER": "fake"}  # the plan names the fake server: no TensorFlow anywhere


def listener(lab: Lab, host: str, port: int) -> subprocess.Popen[str]:
    """A process listening on `port` inside that lab host (its namespace). SO_REUSEADDR: the port
    may still hold connections in TIME-WAIT from an earlier test's server there."""
    h = lab.host(host)
    prefix = ["ip", "netns", "exec", h.netns] if h.netns else []
    code = (f"import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f" s.bind(('0.0.0.0',{port})); s.listen();"
            f"print('ok',flush=True); time.sleep(120)")
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
    return proc


class Site:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.home = tmp_path / "home"
        self._ports: dict[str, list[int]] = {}

    # -- what differs between sites ------------------------------------------------------------
    def host(self, name: str) -> str:
        """The name dtf gives host "a" or "b" in its messages."""
        raise NotImplementedError

    def workdir(self, name: str) -> Path:
        raise NotImplementedError

    def _entry(self, name: str) -> dict[str, Any]:
        raise NotImplementedError

    def _new_ports(self, n: int) -> list[int]:
        raise NotImplementedError

    def processes(self) -> list[tuple[int, str]]:
        """Live processes started from any of the site's workdirs."""
        raise NotImplementedError

    @contextlib.contextmanager
    def hold_port(self, name: str, port: int) -> Iterator[None]:
        raise NotImplementedError
        yield

    # -- the same everywhere ---------------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "DTF_HOME": str(self.home), "COLUMNS": "200", **FAKE, **(extra or {})}

    def dtf(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        return dtf(*args, home=self.home, timeout=timeout, env={**FAKE, **(env or {})})

    def ports_of(self, name: str) -> list[int]:
        return self._ports[name]

    def inventory(self, hosts: dict[str, dict[str, int]], **defaults: Any) -> Path:
        """An inventory of hosts "a"/"b" with counts of tasks, e.g. {"a": {"ps": 1, "workers": 1}}."""
        entries = []
        # One draw for all hosts: on a local site they share one machine, and two separate draws
        # can give two hosts the same port.
        pool = self._new_ports(sum(sum(roles.values()) for roles in hosts.values()))
        for name, roles in hosts.items():
            count = sum(roles.values())
            ports, pool = pool[:count], pool[count:]
            self._ports[name] = ports
            entry = self._entry(name)
            at = 0
            for role in ("ps", "workers"):
                if roles.get(role):
                    entry[role] = ports[at:at + roles[role]]
                    at += roles[role]
            entries.append(entry)
        doc: dict[str, Any] = {"cluster": CLUSTER, **self._top(), "hosts": entries}
        doc.setdefault("defaults", {}).update(defaults)
        path = self.tmp / "inventory.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def _top(self) -> dict[str, Any]:
        return {}

    def crash(self, name: str, task_dir: str) -> None:
        """Make that task's fake server exit as soon as it starts."""
        d = self.workdir(name) / CLUSTER / task_dir
        d.mkdir(parents=True, exist_ok=True)
        (d / "crash").write_text("")

    def supervisor(self, name: str, task_dir: str) -> dict[str, Any]:
        """The task's supervisor.json as its supervisor last wrote it ({} if none yet)."""
        try:
            return dict(json.loads((self.workdir(name) / CLUSTER / task_dir / "supervisor.json").read_text()))
        except (OSError, ValueError):
            return {}

    def files(self) -> list[Path]:
        """What dtf left in the site's workdirs."""
        return [p for name in ("a", "b") if (self.workdir(name) / CLUSTER).exists()
                for p in [self.workdir(name) / CLUSTER, *(self.workdir(name) / CLUSTER).rglob("*")]]

    def record(self) -> Path:
        return self.home / "state" / f"{CLUSTER}.json"

    def cleanup(self) -> None:
        """Take down what a test left up; kill what dtf could not (the test fails on its own)."""
        if self.record().exists():
            self.dtf("down")
        for pid, _ in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class LocalSite(Site):
    """Hosts a and b are `connection: local` hosts with workdirs of their own."""

    def host(self, name: str) -> str:
        return name

    def workdir(self, name: str) -> Path:
        return self.tmp / "hosts" / name

    def _entry(self, name: str) -> dict[str, Any]:
        return {"host": name, "connection": "local", "workdir": str(self.workdir(name))}

    def _new_ports(self, n: int) -> list[int]:
        # Below the range of outgoing connections: a port from bind(0) is in it, and any connect()
        # on this machine may take it before a server binds it (seen with two suites at once).
        return listen_ports(n)

    def processes(self) -> list[tuple[int, str]]:
        needle = str(self.tmp / "hosts")
        out = []
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if needle in cmd and state != "Z":
                out.append((pid, cmd))
        return out

    @contextlib.contextmanager
    def hold_port(self, name: str, port: int) -> Iterator[None]:
        import socket

        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
            s.listen()
            yield


class LabSite(Site):
    """Hosts a and b are the lab's h0 and h1, reached over SSH."""

    NAMES: ClassVar[dict[str, str]] = {"a": "h0", "b": "h1"}

    def __init__(self, tmp_path: Path, lab: Lab) -> None:
        super().__init__(tmp_path)
        self.lab = lab

    def host(self, name: str) -> str:
        return self.NAMES[name]

    def workdir(self, name: str) -> Path:
        return Path(self.lab.host(self.NAMES[name]).workdir)

    def _entry(self, name: str) -> dict[str, Any]:
        return {"host": self.NAMES[name], "workdir": str(self.workdir(name))}

    def _top(self) -> dict[str, Any]:
        return {"ssh_config": str(self.lab.ssh_config),
                "defaults": {"identity_file": str(self.lab.key), "python": sys.executable}}

    def _new_ports(self, n: int) -> list[int]:
        return self.lab.ports(n)

    def processes(self) -> list[tuple[int, str]]:
        return [p for name in ("a", "b") for p in self.lab.processes(self.NAMES[name])]

    @contextlib.contextmanager
    def hold_port(self, name: str, port: int) -> Iterator[None]:
        proc = listener(self.lab, self.NAMES[name], port)
        try:
            yield
        finally:
            proc.kill()
            proc.wait()
