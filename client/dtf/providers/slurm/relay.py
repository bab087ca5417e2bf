"""Slurm in ssh network mode: the tasks reach the coordinator back through a relay on the login
host (scripts/relay.py: why there, in its doc), a command of the login host's runner whose stdin
stays open (a session of its master): it ends with that session."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from dtf.hosts.base import CommandRunner, Conversation, HostError
from dtf.providers.slurm.commands import script_text

RELAY_READY = 20.0  # seconds the login host's relay gets to say where it listens
RELAY_RETRY = 1.0  # seconds between two looks at the relay (started again if its session ended)


class LoginRelay:
    """Slurm: the relay on the login host that carries the tasks' connections to the coordinator
    into the login master's remote forward (dtf.hosts.tunnel's way back). It runs as a command of
    the login host's runner, its stdin kept open, and ends with it; started again if the command
    ended (a lost master) while the tunnel is open."""

    def __init__(self, login: CommandRunner, port: int, nodes: Sequence[str], python: str,
                 timeout: float = RELAY_READY) -> None:
        self.login, self.port, self.nodes, self.python, self.timeout = login, port, list(nodes), python, timeout
        self.conv: Conversation | None = None
        self.address = ""
        self.closed = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="dtf-relay-watch")

    def argv(self) -> list[str]:
        return [self.python, "-c", script_text("relay.py"), str(self.port), str(self.port), *self.nodes]

    def start(self) -> str:
        """Start the relay; the address it listens on (HostError: it did not say in time)."""
        conv = self.conv = self.login.converse(self.argv(), b"")
        text = (conv.readline(self.timeout) or "").strip()
        if not text.startswith("listening "):
            said = conv.finish(1)
            why = text.removeprefix("error: ") or (said.stderr.strip().splitlines() or
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
            if self.conv is not None and self.conv.proc.poll() is None:
                continue
            with contextlib.suppress(HostError, OSError):  # the login host is unreachable now: try again later
                self.login.open()  # (its master started again where it was lost)
                if not self.closed.is_set():
                    self.start()

    def close(self) -> None:
        self.closed.set()
        if self.watcher.is_alive():
            self.watcher.join(timeout=RELAY_RETRY + self.timeout + 5)
        if self.conv is not None:
            self.conv.kill()  # its stdin closes with the session: the relay exits
