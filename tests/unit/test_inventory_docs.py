"""The inventories in the documentation and the shipped ones stay true: every example is checked.

A ```yaml block in docs/*.md or README.md must load as an inventory, unless a ```text block
follows it directly (blank lines aside): then loading it must fail with exactly the text block's
lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtf.cluster.inventory import Inventory, load, loads
from dtf.errors import InventoryError

ROOT = Path(__file__).resolve().parents[2]
INVENTORY_DIR = ROOT / "inventory"
REFERENCE = ROOT / "docs" / "inventory.md"
DOCUMENTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*\n", re.S | re.M)


def yaml_examples(document: Path) -> list[tuple[int, str, list[str] | None]]:
    """(line in the document, yaml text, expected error lines or None) for every ```yaml block."""
    text = document.read_text(encoding="utf-8")
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


EXAMPLES = [(f"{d.relative_to(ROOT)}:{line}", text, expected)
            for d in DOCUMENTS for line, text, expected in yaml_examples(d)]


def test_reference_has_examples() -> None:
    reference = yaml_examples(REFERENCE)
    assert len([e for e in reference if e[2] is None]) >= 3
    assert len([e for e in reference if e[2] is not None]) >= 3


def test_every_task_page_shows_an_inventory() -> None:
    shown = {where.split(":")[0] for where, _, _ in EXAMPLES}
    assert {"README.md", "docs/getting-started.md", "docs/slurm.md", "docs/hosts-and-networks.md"} <= shown


@pytest.mark.parametrize(("where", "text", "expected"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_docs_example(where: str, text: str, expected: list[str] | None) -> None:
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
