"""The exceptions dtf raises on purpose, and the exit code each one maps to.

Everything a user can cause (a bad inventory, an unreachable host, no cluster recorded) is a
DtfError subclass. The CLI turns it into one red line and its exit code; anything else is a bug
and gets a traceback written to a debug log instead of the screen.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # the user's program failed, or a generic failure
    USAGE = 2  # bad command line (Typer's own code)
    INVENTORY = 3  # the inventory file is malformed
    HOSTS = 4  # one or more hosts failed (connect, auth, python, version, port, crash)
    NO_CLUSTER = 5  # no cluster recorded, or the one asked for does not exist
    BUSY = 6  # another dtf command holds the state lock
    CLUSTER_DOWN = 7  # tasks of the recorded cluster are not serving
    CHANGED = 8  # the inventory changed since the cluster was started from it
    NOT_ON_CLUSTER = 9  # the program under `dtf train` would train here, not on the cluster
    INTERRUPTED = 130


class DtfError(Exception):
    """An expected failure: printed as one line, mapped to an exit code."""

    exit_code: ExitCode = ExitCode.FAILURE

    def lines(self) -> list[str]:
        return [str(self)]


class UsageError(DtfError):
    """A bad value on the command line that Typer's types cannot catch (e.g. a duration)."""

    exit_code = ExitCode.USAGE


class InventoryError(DtfError):
    """One or more mistakes in an inventory file, each with file:line:column."""

    exit_code = ExitCode.INVENTORY

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class Problem:
    """One mistake at one place in a file: `inventory.yaml:7:5: hosts[1].workers: expected ...`."""

    __slots__ = ("column", "file", "line", "message", "path")

    def __init__(self, file: str, line: int, column: int, path: str, message: str) -> None:
        self.file, self.line, self.column, self.path, self.message = file, line, column, path, message

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"

    def __repr__(self) -> str:
        return f"Problem({str(self)!r})"


class HostFailure(DtfError):
    """Several hosts failed: one line per host with the reason."""

    exit_code = ExitCode.HOSTS

    def __init__(self, action: str, failures: dict[str, str]) -> None:
        self.action = action
        self.failures = dict(failures)
        super().__init__(f"{action} failed on {len(failures)} host(s)")

    def lines(self) -> list[str]:
        return [f"{self.action} failed on {len(self.failures)} host(s):"] + [
            f"  {host}: {reason}" for host, reason in self.failures.items()
        ]


class NoCluster(DtfError):
    exit_code = ExitCode.NO_CLUSTER


class StateBusy(DtfError):
    exit_code = ExitCode.BUSY


class ClusterDown(DtfError):
    exit_code = ExitCode.CLUSTER_DOWN


class ClusterChanged(DtfError):
    """`dtf up` on an inventory that no longer matches the running cluster: what differs."""

    exit_code = ExitCode.CHANGED

    def __init__(self, cluster: str, was: str, now: str, changes: list[str]) -> None:
        self.changes = list(changes)
        super().__init__(f"cluster {cluster!r} is up from {was}, and {now} differs from it "
                         f"({len(changes)} change(s)); `dtf up --replace {now}` stops it and "
                         f"starts the new one")

    def lines(self) -> list[str]:
        return [str(self)] + [f"  {c}" for c in self.changes]
