"""The inventory reference and the shipped inventories stay true: every example is checked.

A ```yaml block in inventory/README.md must load, unless a ```text block follows it directly
(blank lines aside): then loading it must fail with exactly the text block's lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtf.cluster.inventory import Inventory, load, loads
from dtf.errors import InventoryError

INVENTORY_DIR = Path(__file__).resolve().parents[2] / "inventory"
README = INVENTORY_DIR / "README.md"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*\n", re.S | re.M)


def yaml_examples() -> list[tuple[int, str, list[str] | None]]:
    """(line in README, yaml text, expected error lines or None) for every ```yaml block."""
    text = README.read_text(encoding="utf-8")
    blocks = list(_FENCE.finditer(text))
    examples = []
    for block, after in zip(blocks, blocks[1:] + [None]):
        if block.group(1) != "yaml":
            continue
        expected = None
        if after is not None and after.group(1) == "text" and not text[block.end() : after.start()].strip():
            expected = after.group(2).splitlines()
        examples.append((text.count("\n", 0, block.start()) + 1, block.group(2), expected))
    return examples


EXAMPLES = yaml_examples()


def test_readme_has_examples() -> None:
    assert len([e for e in EXAMPLES if e[2] is None]) >= 3
    assert len([e for e in EXAMPLES if e[2] is not None]) >= 3


@pytest.mark.parametrize(("line", "text", "expected"), EXAMPLES, ids=[f"README.md:{e[0]}" for e in EXAMPLES])
def test_readme_example(line: int, text: str, expected: list[str] | None) -> None:
    if expected is None:
        assert isinstance(loads(text, "inventory.yaml"), Inventory)
    else:
        with pytest.raises(InventoryError) as info:
            loads(text, "inventory.yaml")
        assert info.value.lines() == expected


@pytest.mark.parametrize("path", sorted(INVENTORY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_inventory_loads(path: Path) -> None:
    inventory = load(path)
    assert inventory.num_ps >= 1 and inventory.num_workers >= 1


def test_shipped_inventories_exist() -> None:
    assert {p.name for p in INVENTORY_DIR.glob("*.yaml")} >= {"local.yaml", "example-ssh.yaml"}


def test_local_quick_start() -> None:
    inventory = load(INVENTORY_DIR / "local.yaml")
    assert inventory.cluster == "local"
    (host,) = inventory.hosts
    assert (host.host, host.connection, host.ps_ports, host.worker_ports) == ("localhost", "local", (2222,), (2223, 2224))
    assert host.python == "python3"
