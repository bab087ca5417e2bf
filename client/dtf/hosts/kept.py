"""The arguments of a Slurm node's kept job step (Transport.start_kept; dtf.hosts.slurmstep)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeptStart:
    """The arguments of a node's start_kept: the command, the step's name, the lines it answers,
    its deadline, and the file written on its stdin first (data, dir, filename)."""

    argv: list[str]
    name: str
    lines: int
    timeout: float
    upload: tuple[bytes, str, str] | None = None
