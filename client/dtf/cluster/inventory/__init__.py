"""The inventory: which hosts make the cluster, how to reach them, and which tasks run on each.
See docs/inventory.md for the file itself.

- `model`: the inventory as immutable dataclasses (`Inventory`, `HostSpec`, ...), no YAML;
- `loader`: `load(path)` / `loads(text, filename)`, the file read into the model, or
  `InventoryError` listing every mistake with file:line:column;
- `checks` and `values`: the rules the loader applies, per entry and per value.

Importing this package imports the model alone: most commands only read a cluster's record
(which holds its plan, and so HostSpecs), and PyYAML is loaded by the first `load`.
"""

from __future__ import annotations

from pathlib import Path

from dtf.cluster.inventory.model import (
    ACCELERATORS,
    DEFAULT_HOST_TIMEOUT,
    DEFAULT_PYTHON,
    DEFAULT_RESTART_BACKOFF,
    DEFAULT_RESTART_LIMIT,
    DEFAULT_TF_PORT,
    DEFAULT_WORKDIR,
    FIREWALLS,
    MANAGED,
    NETWORKS,
    HostSpec,
    Inventory,
    Position,
    SlurmSpec,
    SyncSpec,
)

__all__ = [
    "ACCELERATORS", "DEFAULT_HOST_TIMEOUT", "DEFAULT_PYTHON", "DEFAULT_RESTART_BACKOFF", "DEFAULT_RESTART_LIMIT",
    "DEFAULT_TF_PORT", "DEFAULT_WORKDIR", "FIREWALLS", "MANAGED", "NETWORKS", "HostSpec", "Inventory", "Position",
    "SlurmSpec", "SyncSpec", "load", "loads",
]


def load(path: str | Path) -> Inventory:
    """Read and validate an inventory file (dtf.cluster.inventory.loader.load)."""
    from dtf.cluster.inventory import loader

    return loader.load(path)


def loads(text: str, filename: str = "<inventory>") -> Inventory:
    """Validate inventory text (dtf.cluster.inventory.loader.loads)."""
    from dtf.cluster.inventory import loader

    return loader.loads(text, filename)
