"""Slurm in ssh network mode: the tasks reach the coordinator back through a relay on the login
host (scripts/relay.py: why there, in its doc), in a session over the login host's master."""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import subprocess
import threading
import time
from collections.abc import Sequence

from dtf.hosts.masters import Master
from dtf.hosts.transport import HostError
from dtf.providers.slurm.commands import script_text

RELAY_READY = 20.0  # seconds the login host's relay gets to say where it listens
RELAY_RETRY = 1.0  # seconds between two looks at the relay (started again if its session ended)


class LoginRelay:
    """Slurm: the relay on the login host (dtf_server.relay) that carries the tasks' connections to
    the coordinator into the login master's remote forward. It runs in a session over that master
    and ends with it; started again if the session ended (a lost master) while the tunnel is open."""

    def __init__(self, master: Master, port: int, nodes: Sequence[str], python: str,
                 timeout: float = RELAY_READY) -> None:
        self.master, self.port, self.nodes, self.python, self.timeout = master, port, list(nodes), python, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.closed = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="dtf-relay-watch")

    def argv(self) -> list[str]:
        source = script_text("relay.py")
        remote = shlex.join([self.python, "-c", source, str(self.port), str(self.port), *self.nodes])
        return [self.master.ssh, "-S", self.master.path, "-o", "ControlMaster=no", self.master.spec.host, remote]

    def start(self) -> str:
        """Start the relay; the address it listens on (HostError: it did not say in time)."""
        proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self.proc = proc
        assert proc.stdout is not None
        line = b""
        deadline = time.monotonic() + self.timeout
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
        text = line.decode(errors="replace").strip()
        if not text.startswith("listening "):
            self._end()
            err = b""
            if proc.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    err = proc.stderr.read(4096) if proc.poll() is not None else b""
            why = text.removeprefix("error: ") or (err.decode(errors="replace").strip().splitlines() or
                                                  [f"no answer in {self.timeout:g}s"])[-1]
            raise HostError(f"the relay back to the coordinator on the login host failed: {why}")
        self.address = text.split()[1]
        return self.address

    def open(self) -> str:
        address = self.start()
        self.watcher.start()
        return address

    def _watch(self) -> None:
        while not self.closed.wait(RELAY_RETRY):
            if self.proc is not None and self.proc.poll() is None:
                continue
            with contextlib.suppress(HostError, OSError):  # the login host is unreachable now: try again later
                self.master.ensure()
                if not self.closed.is_set():
                    self.start()

    def _end(self) -> None:
        proc = self.proc
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()  # the relay's stdin closes: it exits
        if proc.poll() is None:
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.closed.set()
        if self.watcher.is_alive():
            self.watcher.join(timeout=RELAY_RETRY + self.timeout + 5)
        self._end()

