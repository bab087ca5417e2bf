"""CPU accounting by control group: the CPU time a set of processes and all their descendants
spent, those that have exited included. A process joins a group when it starts (`Popen(...,
preexec_fn=group.join)`) or later (`group.add(pid)`); what it forks stays in the group, so an ssh
control master that forks into the background keeps counting where its dtf command started it.

cgroup v1's cpuacct hierarchy where it is mounted (cpuacct.usage, in ns), else cgroup v2's
(cpu.stat's usage_usec). Needs root. Every group lives below one parent made for this process,
removed by close() (what is still in a group then goes back to the root group).

    with CpuGroups() as groups:
        laptop = groups.make("laptop")
        before = laptop.usage_ns()
        subprocess.run(argv, preexec_fn=laptop.join)
        spent = laptop.usage_ns() - before
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpuacct")


def _v2_root() -> Path | None:
    """Where cgroup v2 is mounted (the unified hierarchy of a hybrid setup too), None if nowhere."""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def _hierarchy(version: int | None) -> Path | None:
    """The hierarchy to account CPU in: version 1 or 2, or (None) v1's cpuacct where it is mounted."""
    if version == 1 or (version is None and V1.is_dir()):
        return V1 if V1.is_dir() else None
    return _v2_root()


def unavailable(version: int | None = None) -> str | None:
    """Why no group can be made here (no hierarchy, or one this process may not write), or None."""
    hierarchy = _hierarchy(version)
    if hierarchy is None:
        return "neither cgroup v1's cpuacct nor cgroup v2 is mounted"
    if not os.access(hierarchy, os.W_OK):
        return f"{hierarchy} is not writable here"
    return None


class CpuGroup:
    def __init__(self, path: Path, v1: bool) -> None:
        self.path, self.v1 = path, v1

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into this group; its later children are born in it."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def join(self) -> None:
        """For Popen's preexec_fn: the child joins before it execs."""
        self.add(os.getpid())

    def usage_ns(self) -> int:
        """CPU time (user and system) its processes have spent since the group was made."""
        if self.v1:
            return int((self.path / "cpuacct.usage").read_text())
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) * 1000
        raise RuntimeError(f"{self.path}/cpu.stat has no usage_usec")

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def holds(self, pid: int) -> bool:
        """Whether process `pid` is in this group (read from the process's side)."""
        mine = "/" + str(self.path.relative_to(self.path.parents[1]))
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            wanted = "cpuacct" in controllers.split(",") if self.v1 else controllers == ""
            if wanted:
                return where.endswith(mine)
        return False


class CpuGroups:
    """A parent group for this process's measurements, and the groups made below it."""

    def __init__(self, version: int | None = None) -> None:
        """version: 1 or 2 to insist on one (None: v1 where its cpuacct hierarchy is mounted)."""
        hierarchy = _hierarchy(version)
        if hierarchy is None:
            raise RuntimeError(f"no cgroup hierarchy to account CPU in: {unavailable(version)}")
        self.v1 = hierarchy == V1
        self.root = hierarchy
        self.parent = hierarchy / f"dtfbench-{os.getpid()}"
        self.groups: list[CpuGroup] = []

    def __enter__(self) -> CpuGroups:
        self.parent.mkdir(exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def make(self, name: str) -> CpuGroup:
        path = self.parent / name
        path.mkdir(exist_ok=True)
        group = CpuGroup(path, self.v1)
        self.groups.append(group)
        return group

    def close(self) -> None:
        """Move whatever is left back to the root group and remove every group."""
        for group in reversed(self.groups):
            for _ in range(5):  # a process may fork while its siblings move
                pids = group.pids()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError):  # exited meanwhile
                        (self.root / "cgroup.procs").write_text(str(pid))
            with contextlib.suppress(OSError):
                group.path.rmdir()
        with contextlib.suppress(OSError):
            self.parent.rmdir()
        self.groups = []
