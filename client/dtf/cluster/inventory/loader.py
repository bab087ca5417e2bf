"""Reading an inventory file: bytes to text, text to YAML nodes (PyYAML's SafeLoader), nodes to a
checked `Inventory` (dtf.cluster.inventory.checks), or `InventoryError` listing every mistake with
file:line:column.

The YAML is only composed into nodes, never constructed into arbitrary objects: nodes carry the
line and column every problem points at, and a scalar is turned into a Python value only for the
plain YAML types (dtf.cluster.inventory.values).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dtf.cluster.inventory.checks import Checker
from dtf.cluster.inventory.model import Inventory
from dtf.errors import InventoryError, Problem


def load(path: str | Path) -> Inventory:
    """Read and validate an inventory file."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        reason = getattr(e, "strerror", None) or str(e)
        raise InventoryError([Problem(name, 1, 1, "", f"cannot read file: {reason}")]) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = _position(data, e.start)
        raise InventoryError([Problem(name, line, column, "", "cannot read file: not UTF-8 text")]) from None
    return loads(text, name)


def loads(text: str, filename: str = "<inventory>") -> Inventory:
    """Validate inventory text; `filename` is used in error messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise InventoryError([Problem(filename, line, column, "", _yaml_message(e))]) from None
    except yaml.YAMLError as e:  # ReaderError: a character YAML does not allow, e.g. NUL
        line, column = _position(text, getattr(e, "position", 0) or 0)
        char = getattr(e, "character", "")
        code = f"#x{char if isinstance(char, int) else ord(char or ' '):04x}"
        message = f"invalid YAML: unacceptable character {code} ({getattr(e, 'reason', 'not allowed')})"
        raise InventoryError([Problem(filename, line, column, "", message)]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InventoryError([Problem(filename, 1, 1, "", "invalid YAML: nested too deeply")]) from None
    checker = Checker(filename)
    inventory = checker.inventory(root)
    if checker.problems or inventory is None:
        raise InventoryError(sorted(checker.problems, key=lambda p: (p.line, p.column)))
    return inventory


def _yaml_message(e: yaml.MarkedYAMLError) -> str:
    problem = str(e.problem or e.context or "cannot parse")
    if problem.startswith("but ") and e.context:  # "expected a single document ..., but found ..."
        problem = f"{e.context}, {problem}"
    if "'\\t'" in problem:
        problem += " (indent with spaces, not tabs)"
    return "invalid YAML: " + " ".join(problem.split())


# Line breaks as YAML counts them (and so every other line number in an error): a lone \r too.
_LINE_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")
_LINE_BREAK_BYTES = re.compile(b"\r\n|[\n\r]|\xc2\x85|\xe2\x80[\xa8\xa9]")


def _position(data: str | bytes, index: int) -> tuple[int, int]:
    """1-based (line, column) of data[index]."""
    line, start = 1, 0
    matches = (_LINE_BREAK.finditer(data, 0, index) if isinstance(data, str)
               else _LINE_BREAK_BYTES.finditer(data, 0, index))
    for match in matches:
        line, start = line + 1, match.end()
    return line, index - start + 1
