"""One inventory value at a time: a YAML node read as what its key expects, or `Invalid` saying
what was expected and what was got ("expected a port number 1..65535, got 70000").

Only plain YAML scalars (str, int, float, bool, null) become Python values; anything else keeps
its tag and is described, never constructed.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Iterator
from typing import TypeGuard

import yaml

from dtf.cluster.inventory.model import (
    ACCELERATORS,
    DEFAULT_PYTHON,
    DEFAULT_RESTART_BACKOFF,
    DEFAULT_RESTART_LIMIT,
    DEFAULT_TF_PORT,
    DEFAULT_WORKDIR,
    FIREWALLS,
)

MAX_TASKS_PER_HOST = 1000
_MAX_RESTART_LIMIT = 1_000_000
_MAX_RESTART_BACKOFF = 3600
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_SHELL_CHARS = frozenset(";&|$`'\"<>()\\*?[]{}!#~^")
_Y = "tag:yaml.org,2002:"
STR, NULL, MERGE = (_Y + t for t in ("str", "null", "merge"))
_INT, _FLOAT, _BOOL, _SEQ, _MAP, _TIMESTAMP = (_Y + t for t in ("int", "float", "bool", "seq", "map", "timestamp"))
_SCALARS = (_INT, _FLOAT, _BOOL, NULL)


@functools.cache
def _constructor() -> yaml.constructor.SafeConstructor:
    return yaml.constructor.SafeConstructor()  # only its scalar methods are used: no state


class Invalid(Exception):
    """A value is not what the schema expects; the message says what was expected and got."""


class _Marker:
    """A value that is never valid but still has a description (a date, a 60-digit number)."""


TOO_BIG, _DATE, INVALID = _Marker(), _Marker(), _Marker()


def is_map(node: yaml.Node) -> TypeGuard[yaml.MappingNode]:
    return isinstance(node, yaml.MappingNode) and node.tag == _MAP


def is_seq(node: yaml.Node) -> TypeGuard[yaml.SequenceNode]:
    return isinstance(node, yaml.SequenceNode) and node.tag == _SEQ


def short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _tag(tag: str) -> str:
    return "!!" + tag[len(_Y) :] if tag.startswith(_Y) else tag


def describe(node: yaml.Node) -> str:
    """What a node holds, for "got ..." in messages: 'two', 70000, a list, a boolean (yes)."""
    if is_map(node):
        return "a mapping"
    if is_seq(node):
        return "an empty list" if not node.value else "a list"
    if not isinstance(node, yaml.ScalarNode):
        return f"a value with the unsupported tag {short(_tag(node.tag))}"
    raw: str = node.value
    if node.tag == STR:
        return short(raw) if raw else "an empty string"
    if node.tag == _INT:
        digits = raw.lstrip("+-").replace("_", "")
        if len(raw) <= 20:
            return raw
        return f"a {len(digits)}-digit number" if digits.isdigit() else "a very large number"
    if node.tag == _FLOAT:
        return raw if len(raw) <= 20 else "a number"
    if node.tag == _BOOL:
        return f"a boolean ({raw})"
    if node.tag == NULL:
        return "null" if raw else "nothing"
    if node.tag == _TIMESTAMP:
        return f"a date ({raw[:40]})"
    return f"a value with the unsupported tag {short(_tag(node.tag))}"


def plain(node: yaml.Node) -> object:
    """A scalar's Python value (lists and mappings stay nodes); an unknown tag is `Invalid`."""
    if is_map(node) or is_seq(node):
        return node
    if isinstance(node, yaml.ScalarNode):
        if node.tag == STR:
            return node.value
        if node.tag == _TIMESTAMP:
            return _DATE
        if node.tag == _INT and len(node.value) > 50:  # no valid number is this long
            return TOO_BIG
        if node.tag in _SCALARS:
            try:
                constructor = _constructor()
                return constructor.yaml_constructors[node.tag](constructor, node)
            except Exception:  # an explicit tag on a value it cannot hold: `!!int ''`, `!!bool x`
                raise Invalid(f"invalid {_tag(node.tag)} value {short(node.value)}") from None
    raise Invalid(f"unsupported YAML tag {short(_tag(node.tag))}")


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # `port: yes` is not 1


# -- value readers: each returns the value or raises Invalid -------------------------------------


def read_string(node: yaml.Node, what: str) -> str:
    value = plain(node)
    if not isinstance(value, str) or not value:
        raise Invalid(f"expected {what}, got {describe(node)}")
    return value


def _name_flaw(name: str) -> str | None:
    if any(unicodedata.category(c).startswith("C") for c in name):
        return "without control characters or newlines"
    if any(c in _SHELL_CHARS for c in name):
        return "without quotes or shell characters such as ; $ ` ( ) < > |"
    if any(c.isspace() for c in name):
        return "without whitespace"
    if name.startswith("-"):
        return "not starting with '-'"
    return None


def _machine_flaw(name: str, hints: tuple[str, str]) -> str | None:
    """SSH (Fabric) reads `user@host:port` out of a host string, and TF reads `addr:port`: a
    machine is named without either, or ssh would connect elsewhere than the inventory says (or
    fail on `user:` and `port:` given twice). IPv6 addresses have two or more colons."""
    if "@" in name:
        return "without '@'" + hints[0]
    if name.count(":") == 1:
        return "without ':PORT'" + hints[1]
    return None


HOST_HINTS = (" (set the login name with user:)", " (set the SSH port with port:)")
ADDRESS_HINTS = ("", " (TF ports come from ps, workers and tf_port)")


def name_reader(what: str, machine: tuple[str, str] | None = None) -> Callable[[yaml.Node], str]:
    """Host names, addresses and user names end up in ssh and TF argv: keep them plain words.
    A machine's name (host, address) has no `user@` or `:port` either; `machine` holds the hints."""

    def read(node: yaml.Node) -> str:
        name = read_string(node, what)
        flaw = _name_flaw(name) or (_machine_flaw(name, machine) if machine else None)
        if flaw:
            raise Invalid(f"expected {what} {flaw}, got {short(name)}")
        return name

    return read


def read_path(node: yaml.Node) -> str:
    # Spaces and quotes are fine: remote commands are quoted in one place. Newlines and NUL are not.
    path = read_string(node, "a path")
    if any(c in "\n\r\0" for c in path):
        raise Invalid(f"expected a path without newlines or NUL characters, got {short(path)}")
    return path


def read_port(node: yaml.Node) -> int:
    value = plain(node)
    if not is_int(value) or not 1 <= value <= 65535:
        raise Invalid(f"expected a port number 1..65535, got {describe(node)}")
    return value


_MAX_GPUS = 1024


def read_restart_limit(node: yaml.Node) -> int:
    value = plain(node)
    if not is_int(value) or not 0 <= value <= _MAX_RESTART_LIMIT:  # a 60-digit number is TOO_BIG
        raise Invalid(f"expected a whole number 0..{_MAX_RESTART_LIMIT}, got {describe(node)}")
    return value


def read_gpus(node: yaml.Node) -> tuple[int, ...]:
    """`gpus`: a count (ids 0..N-1) or a list of distinct device ids."""
    value = plain(node)
    if is_int(value) and 0 <= value <= _MAX_GPUS:
        return tuple(range(value))
    if isinstance(value, yaml.SequenceNode):
        ids = [plain(item) for item in value.value]
        if all(is_int(i) and 0 <= i <= _MAX_GPUS for i in ids) and len(set(ids)) == len(ids):
            return tuple(ids)  # type: ignore[arg-type]
    raise Invalid(f"expected a number of GPUs 0..{_MAX_GPUS} or a list of distinct GPU ids, got {describe(node)}")


def read_seconds(node: yaml.Node) -> float:
    value = plain(node)
    # NaN fails every comparison; inf and huge numbers fail the upper bound.
    if not (is_int(value) or isinstance(value, float)) or not 0 <= value <= _MAX_RESTART_BACKOFF:
        raise Invalid(f"expected a number of seconds 0..{_MAX_RESTART_BACKOFF}, got {describe(node)}")
    return float(value) + 0.0  # -0.0 becomes 0.0


_MAX_HOST_TIMEOUT = 86400
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smh]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def read_host_timeout(node: yaml.Node) -> float:
    """`host_timeout`: seconds (a number, or 90s, 2m, 1h), more than 0 and at most a day."""
    value = plain(node)
    seconds: float | None = None
    if is_int(value) or isinstance(value, float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip().lower())):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds is None or not 0 < seconds <= _MAX_HOST_TIMEOUT:  # (NaN fails it too)
        raise Invalid(f"expected a duration more than 0 and at most 1 day (60, 90s, 2m), got {describe(node)}")
    return seconds


# A requirement as pip and uv read it: a name, extras, a version specifier, a marker. Never an
# option (a line starting with '-' would be one in a requirements file).
_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._, -]*\])?\s*([<>=!~;@ ][^\n\r]*)?")


def read_strings(node: yaml.Node, expected: str, ok: Callable[[str], object]) -> Iterator[str]:
    """A list's strings, in order, each of which passes `ok`; Invalid naming `expected` at the
    first that does not (a caller's own checks of each come before the next item's)."""
    value = plain(node)
    if not isinstance(value, yaml.SequenceNode):
        raise Invalid(f"expected {expected}, got {describe(node)}")
    for item in value.value:
        text = plain(item)
        if not isinstance(text, str) or not ok(text):
            raise Invalid(f"expected {expected}, got {describe(item)} in the list")
        yield text


def read_packages(node: yaml.Node) -> tuple[str, ...]:
    texts = read_strings(node, "a list of requirements such as 'pandas==2.2.3' or 'scipy>=1.13'",
                         lambda text: _REQUIREMENT.fullmatch(text.strip()))
    return tuple(text.strip() for text in texts)


# Slurm's time formats (sbatch --time): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"\d{1,9}(:\d{1,2}){0,2}|\d{1,5}-\d{1,2}(:\d{1,2}){0,2}")
_SLURM_JOB = re.compile(r"[1-9][0-9]{0,11}")
_MAX_NODES = 100_000
# Allocation options dtf sets itself (from the keys named here), or that would break what it asks for.
_SBATCH_OWN = {"-N": "nodes", "--nodes": "nodes", "-p": "partition", "--partition": "partition",
               "-t": "time", "--time": "time", "-A": "account", "--account": "account", "-q": "qos",
               "--qos": "qos", "--gpus-per-node": "gpus_per_node", "-J": None, "--job-name": None,
               "-n": None, "--ntasks": None, "--ntasks-per-node": None, "-H": None, "--hold": None,
               "--no-shell": None}
# sbatch's options for a batch script, which salloc (what dtf asks for its allocation with) has not.
_BATCH_ONLY = {"--wrap", "--parsable", "-o", "--output", "-e", "--error", "-i", "--input", "-a", "--array",
               "-W", "--wait", "--export", "--export-file", "--ignore-pbs", "--propagate", "--requeue",
               "--no-requeue"}


def read_slurm_time(node: yaml.Node) -> str:
    # YAML 1.1 reads 1:30:00 as a number (base 60): the text as written is what Slurm gets.
    if isinstance(node, yaml.ScalarNode) and node.tag in (STR, _INT) and _SLURM_TIME.fullmatch(node.value):
        return str(node.value)
    raise Invalid(f"expected a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS, e.g. '1:30:00'), "
                   f"got {describe(node)}")


def read_slurm_job(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode) and node.tag in (STR, _INT) and _SLURM_JOB.fullmatch(node.value):
        return str(node.value)
    raise Invalid(f"expected a Slurm job id (a whole number, as squeue shows it), got {describe(node)}")


def read_nodes(node: yaml.Node) -> int:
    value = plain(node)
    if not is_int(value) or not 1 <= value <= _MAX_NODES:
        raise Invalid(f"expected a number of nodes 1..{_MAX_NODES}, got {describe(node)}")
    return value


def read_gpus_per_node(node: yaml.Node) -> int:
    value = plain(node)
    if not is_int(value) or not 0 <= value <= _MAX_GPUS:
        raise Invalid(f"expected a number of GPUs per node 0..{_MAX_GPUS}, got {describe(node)}")
    return value


_GRES_GPU = re.compile(r"gpu(?::[\w.-]+)?(?::(\d+))?")


def gres_gpus(sbatch: tuple[str, ...]) -> int | None:
    """The GPUs per node that a `--gres=...` among the sbatch options asks for (`gpu:4`,
    `gpu:a100:4`, `gpu`: 1); None: it asks for none."""
    for option in sbatch:
        if option.startswith("--gres="):
            for item in option.split("=", 1)[1].split(","):
                m = _GRES_GPU.fullmatch(item.strip())
                if m:
                    return int(m.group(1) or 1)
    return None


def read_sbatch(node: yaml.Node) -> tuple[str, ...]:
    """More sbatch options: a list of options, each one argument (`--constraint=a100`)."""
    options = []
    for text in read_strings(node, "a list of sbatch options such as '--constraint=a100' or '--exclusive'",
                             lambda text: text.startswith("-") and not any(c in text for c in "\n\r\0")):
        name = text.split("=", 1)[0] if text.startswith("--") else text[:2]
        if name in _SBATCH_OWN:
            key = _SBATCH_OWN[name]
            why = f"set it with slurm.{key}" if key else "dtf sets it itself"
            raise Invalid(f"{text!r} in the list: {why}")
        if name in _BATCH_ONLY:
            raise Invalid(f"{text!r} in the list: a batch script's option; dtf asks for the allocation "
                           f"with salloc, which takes the others")
        options.append(text)
    return tuple(options)


def read_connection(node: yaml.Node) -> str:
    value = plain(node)
    if value not in ("ssh", "local"):
        raise Invalid(f"expected 'ssh' or 'local', got {describe(node)}")
    return value


def read_cluster(node: yaml.Node) -> str:
    name = read_string(node, "a cluster name")
    if not _CLUSTER_NAME.fullmatch(name):
        raise Invalid(
            "expected a cluster name of at most 63 letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit, got {short(name)}"
        )
    return name


def choice(options: tuple[str, ...]) -> Callable[[yaml.Node], str]:
    def read(node: yaml.Node) -> str:
        value = plain(node)
        if value not in options:
            raise Invalid(f"expected {', '.join(map(repr, options[:-1]))} or {options[-1]!r}, "
                           f"got {describe(node)}")
        return str(value)

    return read


def read_firewall(node: yaml.Node) -> str:
    """`firewall:`, one of FIREWALLS (`off` as written, which YAML 1.1 reads as a boolean); `none`,
    its old name for `off`, is refused with the new one."""
    if isinstance(node, yaml.ScalarNode) and node.value == "off" and node.style is None:
        return "off"
    if plain(node) == "none":
        raise Invalid("'none' is now called 'off' (the TF ports open to anyone who reaches them); "
                      "without the key, auto closes them to all but the cluster where the host allows it")
    return choice(FIREWALLS)(node)


def optional(read: Callable[[yaml.Node], object]) -> Callable[[yaml.Node], object]:
    """`null` means "not set": ssh_config or the built-in default decides."""
    return lambda node: None if plain(node) is None else read(node)


# What each setting of a host (and of `defaults`) holds, and its built-in value.
SETTINGS: dict[str, Callable[[yaml.Node], object]] = {
    "connection": read_connection,
    "user": optional(name_reader("a user name")),
    "port": optional(read_port),
    "identity_file": optional(read_path),
    "python": read_path,
    "workdir": read_path,
    "address": optional(name_reader("an address", ADDRESS_HINTS)),
    "tf_port": read_port,
    "restart_limit": read_restart_limit,
    "restart_backoff": read_seconds,
    "base_python": read_path,
    "packages": read_packages,
    "accelerator": choice(ACCELERATORS),
    "gpus": optional(read_gpus),
}
BUILTIN: dict[str, object] = dict.fromkeys(SETTINGS) | {
    "connection": "ssh", "python": DEFAULT_PYTHON, "workdir": DEFAULT_WORKDIR, "tf_port": DEFAULT_TF_PORT,
    "restart_limit": DEFAULT_RESTART_LIMIT, "restart_backoff": DEFAULT_RESTART_BACKOFF,
    "base_python": DEFAULT_PYTHON, "packages": (), "accelerator": "none",
}
# `slurm:`'s allocation: what Slurm is asked for (salloc's options).
SLURM_ALLOCATION: dict[str, Callable[[yaml.Node], object]] = {
    "nodes": read_nodes, "partition": name_reader("a partition name"), "time": read_slurm_time,
    "account": name_reader("an account name"), "qos": name_reader("a QOS name"),
    "gpus_per_node": read_gpus_per_node, "sbatch": read_sbatch,
}
