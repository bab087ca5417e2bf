"""The inventory: which hosts make the cluster, how to reach them, and which tasks run on each.

Parsing is pure: `loads(text, filename)` returns a validated, immutable `Inventory` or raises
`InventoryError` listing every mistake with file:line:column. See inventory/README.md.

The YAML is only composed into nodes (`yaml.compose` with SafeLoader), never constructed into
arbitrary objects: nodes carry the line and column every problem points at, and a scalar is
turned into a Python value only for the plain YAML types (str, int, float, bool, null).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import re
import sys
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

from dtf.errors import InventoryError, Problem
from dtf_server.protocol import Defaults

if TYPE_CHECKING:
    import yaml
else:
    # PyYAML is loaded when an inventory is read, not whenever this module is imported: the model
    # below is what most commands use (a cluster's record holds its plan), and importing yaml cost
    # each of them 25 ms. importlib's lazy loader: the module executes at its first attribute use.
    yaml = sys.modules.get("yaml")
    if yaml is None:
        _spec = importlib.util.find_spec("yaml")
        assert _spec is not None and _spec.loader is not None, "PyYAML is a dependency of dtf"
        _spec.loader = importlib.util.LazyLoader(_spec.loader)
        yaml = sys.modules["yaml"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(yaml)

DEFAULT_TF_PORT = 2222
DEFAULT_PYTHON = "python3"
MANAGED = "managed"  # `python: managed`: dtf builds the environment (see dtf.files.environment)
ACCELERATORS = ("none", "cuda")
DEFAULT_WORKDIR = "~/.dtf"
DEFAULT_RESTART_LIMIT = Defaults.RESTART_LIMIT  # host-side defaults live in one place
DEFAULT_RESTART_BACKOFF = Defaults.RESTART_BACKOFF


@dataclass(frozen=True)
class HostSpec:
    host: str  # as written: a name, an address, or a ~/.ssh/config alias
    line: int  # where this host's entry starts in the file (1-based), for later error messages
    connection: str  # "ssh" or "local"
    user: str | None  # None: ~/.ssh/config or the local user decides
    port: int | None  # SSH port; None: ~/.ssh/config or 22
    identity_file: str | None
    python: str  # the python that runs the launcher on that host
    workdir: str  # where dtf keeps its files on that host (may start with ~/)
    address: str | None  # the address other tasks reach this host's TF servers at; None: derived
    ps_ports: tuple[int, ...]  # one TF server port per ps task on this host
    worker_ports: tuple[int, ...]  # one TF server port per worker task on this host
    # The last fields have defaults: records saved before they existed still load (HostSpec(**d)).
    restart_limit: int = DEFAULT_RESTART_LIMIT  # restarts of a dead task's server before giving up; 0: never
    restart_backoff: float = DEFAULT_RESTART_BACKOFF  # seconds before a restart; doubles on quick deaths, max 60
    # `python: managed`: dtf builds the host's environment (dtf.files.environment) on `base_python`,
    # with the pinned TensorFlow (the CUDA build with accelerator cuda) plus `packages`.
    base_python: str = DEFAULT_PYTHON
    packages: tuple[str, ...] = ()
    accelerator: str = "none"

    @property
    def managed(self) -> bool:
        return self.python == MANAGED
    gpus: tuple[int, ...] | None = None  # the host's GPU ids, shared among its workers (cluster/gpus.py); None: not set


@dataclass(frozen=True)
class SyncSpec:
    """One entry of `sync:`: a local path sent to every host at `up` (dtf.files.sync)."""

    path: str  # as written (`~/` is this machine's home; relative: to the inventory's directory)
    name: str  # what dtf.synced(NAME) finds it by: `as`, else the path's last part
    line: int  # where the entry is (1-based), for "no such file" at `up`
    column: int


@dataclass(frozen=True)
class SlurmSpec:
    """`slurm:` in place of `hosts:`: the cluster's nodes come from a Slurm allocation, made through
    the login host (dtf.cluster.slurm builds the commands). Either `nodes` (dtf submits an
    allocation, and cancels it at `down`) or `job` (an allocation the user made: used, never
    cancelled)."""

    login: HostSpec  # the login host: an SSH host like any other (ssh_config, ProxyJump, agent); no tasks
    node: HostSpec  # what every node of the allocation runs: python, workdir, ports per node (host is "")
    line: int  # where `slurm:` is (1-based)
    nodes: int | None = None  # how many nodes to allocate; None with `job`
    job: str | None = None  # an existing allocation's id
    partition: str | None = None
    time: str | None = None  # Slurm's time limit, as written (`90`, `1:30:00`, `2-00:00:00`)
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = None
    sbatch: tuple[str, ...] = ()  # more allocation options (sbatch's, but for a batch script's), to salloc as written

    @property
    def submits(self) -> bool:
        """dtf makes the allocation (and so cancels it); False: the user's `job`."""
        return self.job is None


# How the laptop reaches the tasks' TF ports: directly, through SSH, or whichever works (auto).
NETWORKS = ("auto", "direct", "ssh")
# Who may connect to the tasks' TF ports: anyone who can reach them, or only the cluster's hosts.
FIREWALLS = ("none", "members")


@dataclass(frozen=True)
class Inventory:
    path: str  # the file it was read from, as given
    cluster: str  # the cluster's name
    hosts: tuple[HostSpec, ...]
    ssh_config: str | None  # an ssh_config file to read instead of ~/.ssh/config
    network: str = "auto"  # one of NETWORKS
    firewall: str = "none"  # one of FIREWALLS
    sync: tuple[SyncSpec, ...] = ()  # sent to every host at `up`
    # `slurm:` in place of `hosts:` (hosts is then empty until the allocation names the nodes:
    # `with_nodes`).
    slurm: SlurmSpec | None = None

    def with_nodes(self, names: tuple[str, ...]) -> Inventory:
        """A Slurm inventory whose allocation runs on these nodes: one host per node, each with
        the node layout (`slurm.node`), in Slurm's order."""
        assert self.slurm is not None
        node = self.slurm.node
        return dataclasses.replace(self, hosts=tuple(dataclasses.replace(node, host=n) for n in names))

    @property
    def num_ps(self) -> int:
        return sum(len(h.ps_ports) for h in self.hosts)

    @property
    def num_workers(self) -> int:
        return sum(len(h.worker_ports) for h in self.hosts)


# The inventories this process has read, by name and bytes: `up` reads its inventory before the
# CLI has loaded (dtf.entry: its masters begin early) and again when it plans, and an Inventory is
# immutable. A file that changed in between is read anew.
_loaded: dict[tuple[str, bytes], Inventory] = {}


def load(path: str | Path) -> Inventory:
    """Read and validate an inventory file."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        reason = getattr(e, "strerror", None) or str(e)
        raise InventoryError([Problem(name, 1, 1, "", f"cannot read file: {reason}")]) from None
    if (name, data) in _loaded:
        return _loaded[name, data]
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = _position(data, e.start)
        raise InventoryError([Problem(name, line, column, "", "cannot read file: not UTF-8 text")]) from None
    inventory = _loaded[name, data] = loads(text, name)
    return inventory


def _compose(text: str) -> yaml.Node | None:
    """The YAML's node tree. By libyaml (PyYAML's CSafeLoader) where PyYAML has it and the text is
    ASCII: a 100-host inventory took 28 ms to compose in Python, 2 ms so, and `up` reads its
    inventory before it reaches any host. The nodes, tags and marks are the same; for any other
    text, and for a text libyaml refuses, PyYAML's own parser, whose messages are dtf's."""
    if text.isascii() and getattr(yaml, "__with_libyaml__", False):
        try:
            return yaml.compose(text, Loader=yaml.CSafeLoader)
        except Exception:  # (what is wrong with it: said as PyYAML says it, below)
            pass
    return yaml.compose(text, Loader=yaml.SafeLoader)


def loads(text: str, filename: str = "<inventory>") -> Inventory:
    """Validate inventory text; `filename` is used in error messages."""
    try:
        root = _compose(text)
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
    checker = _Checker(filename)
    inventory = checker.inventory(root)
    if checker.problems or inventory is None:
        raise InventoryError(sorted(checker.problems, key=lambda p: (p.line, p.column)))
    return inventory


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


# -- scalars and their descriptions ------------------------------------------------------------

_MAX_TASKS_PER_HOST = 1000
_MAX_RESTART_LIMIT = 1_000_000
_MAX_RESTART_BACKOFF = 3600
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_SHELL_CHARS = frozenset(";&|$`'\"<>()\\*?[]{}!#~^")
_Y = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_Y + t for t in ("str", "int", "float", "bool", "null"))
_SEQ, _MAP, _TIMESTAMP, _MERGE = (_Y + t for t in ("seq", "map", "timestamp", "merge"))
_SCALARS = (_INT, _FLOAT, _BOOL, _NULL)


@functools.cache
def _constructor() -> yaml.constructor.SafeConstructor:
    return yaml.constructor.SafeConstructor()  # only its scalar methods are used: no state


class _Invalid(Exception):
    """A value is not what the schema expects; the message says what was expected and got."""


class _Marker:
    """A value that is never valid but still has a description (a date, a 60-digit number)."""


_TOO_BIG, _DATE, _INVALID = _Marker(), _Marker(), _Marker()


def _is_map(node: yaml.Node) -> TypeGuard[yaml.MappingNode]:
    return isinstance(node, yaml.MappingNode) and node.tag == _MAP


def _is_seq(node: yaml.Node) -> TypeGuard[yaml.SequenceNode]:
    return isinstance(node, yaml.SequenceNode) and node.tag == _SEQ


def _yaml_message(e: yaml.MarkedYAMLError) -> str:
    problem = str(e.problem or e.context or "cannot parse")
    if problem.startswith("but ") and e.context:  # "expected a single document ..., but found ..."
        problem = f"{e.context}, {problem}"
    if "'\\t'" in problem:
        problem += " (indent with spaces, not tabs)"
    return "invalid YAML: " + " ".join(problem.split())


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _tag(tag: str) -> str:
    return "!!" + tag[len(_Y) :] if tag.startswith(_Y) else tag


def _describe(node: yaml.Node) -> str:
    """What a node holds, for "got ..." in messages: 'two', 70000, a list, a boolean (yes)."""
    if _is_map(node):
        return "a mapping"
    if _is_seq(node):
        return "an empty list" if not node.value else "a list"
    if not isinstance(node, yaml.ScalarNode):
        return f"a value with the unsupported tag {_short(_tag(node.tag))}"
    raw: str = node.value
    if node.tag == _STR:
        return _short(raw) if raw else "an empty string"
    if node.tag == _INT:
        digits = raw.lstrip("+-").replace("_", "")
        if len(raw) <= 20:
            return raw
        return f"a {len(digits)}-digit number" if digits.isdigit() else "a very large number"
    if node.tag == _FLOAT:
        return raw if len(raw) <= 20 else "a number"
    if node.tag == _BOOL:
        return f"a boolean ({raw})"
    if node.tag == _NULL:
        return "null" if raw else "nothing"
    if node.tag == _TIMESTAMP:
        return f"a date ({raw[:40]})"
    return f"a value with the unsupported tag {_short(_tag(node.tag))}"


def _plain(node: yaml.Node) -> object:
    """A scalar's Python value (lists and mappings stay nodes); an unknown tag is `_Invalid`."""
    if _is_map(node) or _is_seq(node):
        return node
    if isinstance(node, yaml.ScalarNode):
        if node.tag == _STR:
            return node.value
        if node.tag == _TIMESTAMP:
            return _DATE
        if node.tag == _INT and len(node.value) > 50:  # no valid number is this long
            return _TOO_BIG
        if node.tag in _SCALARS:
            try:
                constructor = _constructor()
                return constructor.yaml_constructors[node.tag](constructor, node)
            except Exception:  # an explicit tag on a value it cannot hold: `!!int ''`, `!!bool x`
                raise _Invalid(f"invalid {_tag(node.tag)} value {_short(node.value)}") from None
    raise _Invalid(f"unsupported YAML tag {_short(_tag(node.tag))}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # `port: yes` is not 1


# -- value readers: each returns the value or raises _Invalid -------------------------------------


def _read_string(node: yaml.Node, what: str) -> str:
    value = _plain(node)
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected {what}, got {_describe(node)}")
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


_HOST_HINTS = (" (set the login name with user:)", " (set the SSH port with port:)")
_ADDRESS_HINTS = ("", " (TF ports come from ps, workers and tf_port)")


def _name_reader(what: str, machine: tuple[str, str] | None = None) -> Callable[[yaml.Node], str]:
    """Host names, addresses and user names end up in ssh and TF argv: keep them plain words.
    A machine's name (host, address) has no `user@` or `:port` either; `machine` holds the hints."""

    def read(node: yaml.Node) -> str:
        name = _read_string(node, what)
        flaw = _name_flaw(name) or (_machine_flaw(name, machine) if machine else None)
        if flaw:
            raise _Invalid(f"expected {what} {flaw}, got {_short(name)}")
        return name

    return read


def _read_path(node: yaml.Node) -> str:
    # Spaces and quotes are fine: remote commands are quoted in one place. Newlines and NUL are not.
    path = _read_string(node, "a path")
    if any(c in "\n\r\0" for c in path):
        raise _Invalid(f"expected a path without newlines or NUL characters, got {_short(path)}")
    return path


def _read_port(node: yaml.Node) -> int:
    value = _plain(node)
    if not _is_int(value) or not 1 <= value <= 65535:
        raise _Invalid(f"expected a port number 1..65535, got {_describe(node)}")
    return value


_MAX_GPUS = 1024


def _read_restart_limit(node: yaml.Node) -> int:
    value = _plain(node)
    if not _is_int(value) or not 0 <= value <= _MAX_RESTART_LIMIT:  # a 60-digit number is _TOO_BIG
        raise _Invalid(f"expected a whole number 0..{_MAX_RESTART_LIMIT}, got {_describe(node)}")
    return value


def _read_gpus(node: yaml.Node) -> tuple[int, ...]:
    """`gpus`: a count (ids 0..N-1) or a list of distinct device ids."""
    value = _plain(node)
    if _is_int(value) and 0 <= value <= _MAX_GPUS:
        return tuple(range(value))
    if isinstance(value, yaml.SequenceNode):
        ids = [_plain(item) for item in value.value]
        if all(_is_int(i) and 0 <= i <= _MAX_GPUS for i in ids) and len(set(ids)) == len(ids):
            return tuple(ids)  # type: ignore[arg-type]
    raise _Invalid(f"expected a number of GPUs 0..{_MAX_GPUS} or a list of distinct GPU ids, got {_describe(node)}")


def _read_seconds(node: yaml.Node) -> float:
    value = _plain(node)
    # NaN fails every comparison; inf and huge numbers fail the upper bound.
    if not (_is_int(value) or isinstance(value, float)) or not 0 <= value <= _MAX_RESTART_BACKOFF:
        raise _Invalid(f"expected a number of seconds 0..{_MAX_RESTART_BACKOFF}, got {_describe(node)}")
    return float(value) + 0.0  # -0.0 becomes 0.0


# A requirement as pip and uv read it: a name, extras, a version specifier, a marker. Never an
# option (a line starting with '-' would be one in a requirements file).
_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._, -]*\])?\s*([<>=!~;@ ][^\n\r]*)?")


def _read_packages(node: yaml.Node) -> tuple[str, ...]:
    value = _plain(node)
    expected = "a list of requirements such as 'pandas==2.2.3' or 'scipy>=1.13'"
    if not isinstance(value, yaml.SequenceNode):
        raise _Invalid(f"expected {expected}, got {_describe(node)}")
    packages = []
    for item in value.value:
        text = _plain(item)
        if not isinstance(text, str) or not _REQUIREMENT.fullmatch(text.strip()):
            raise _Invalid(f"expected {expected}, got {_describe(item)} in the list")
        packages.append(text.strip())
    return tuple(packages)


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


def _read_slurm_time(node: yaml.Node) -> str:
    # YAML 1.1 reads 1:30:00 as a number (base 60): the text as written is what Slurm gets.
    if isinstance(node, yaml.ScalarNode) and node.tag in (_STR, _INT) and _SLURM_TIME.fullmatch(node.value):
        return str(node.value)
    raise _Invalid(f"expected a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS, e.g. '1:30:00'), "
                   f"got {_describe(node)}")


def _read_slurm_job(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode) and node.tag in (_STR, _INT) and _SLURM_JOB.fullmatch(node.value):
        return str(node.value)
    raise _Invalid(f"expected a Slurm job id (a whole number, as squeue shows it), got {_describe(node)}")


def _read_nodes(node: yaml.Node) -> int:
    value = _plain(node)
    if not _is_int(value) or not 1 <= value <= _MAX_NODES:
        raise _Invalid(f"expected a number of nodes 1..{_MAX_NODES}, got {_describe(node)}")
    return value


def _read_gpus_per_node(node: yaml.Node) -> int:
    value = _plain(node)
    if not _is_int(value) or not 0 <= value <= _MAX_GPUS:
        raise _Invalid(f"expected a number of GPUs per node 0..{_MAX_GPUS}, got {_describe(node)}")
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


def _read_sbatch(node: yaml.Node) -> tuple[str, ...]:
    """More sbatch options: a list of options, each one argument (`--constraint=a100`)."""
    value = _plain(node)
    expected = "a list of sbatch options such as '--constraint=a100' or '--exclusive'"
    if not isinstance(value, yaml.SequenceNode):
        raise _Invalid(f"expected {expected}, got {_describe(node)}")
    options = []
    for item in value.value:
        text = _plain(item)
        if not isinstance(text, str) or not text.startswith("-") or any(c in text for c in "\n\r\0"):
            raise _Invalid(f"expected {expected}, got {_describe(item)} in the list")
        name = text.split("=", 1)[0] if text.startswith("--") else text[:2]
        if name in _SBATCH_OWN:
            key = _SBATCH_OWN[name]
            why = f"set it with slurm.{key}" if key else "dtf sets it itself"
            raise _Invalid(f"{text!r} in the list: {why}")
        if name in _BATCH_ONLY:
            raise _Invalid(f"{text!r} in the list: a batch script's option; dtf asks for the allocation "
                           f"with salloc, which takes the others")
        options.append(text)
    return tuple(options)


def _read_connection(node: yaml.Node) -> str:
    value = _plain(node)
    if value not in ("ssh", "local"):
        raise _Invalid(f"expected 'ssh' or 'local', got {_describe(node)}")
    return value


def _read_cluster(node: yaml.Node) -> str:
    name = _read_string(node, "a cluster name")
    if not _CLUSTER_NAME.fullmatch(name):
        raise _Invalid(
            "expected a cluster name of at most 63 letters, digits, '_', '.' or '-', "
            f"starting with a letter or digit, got {_short(name)}"
        )
    return name


def _choice(options: tuple[str, ...]) -> Callable[[yaml.Node], str]:
    def read(node: yaml.Node) -> str:
        value = _plain(node)
        if value not in options:
            raise _Invalid(f"expected {', '.join(map(repr, options[:-1]))} or {options[-1]!r}, "
                           f"got {_describe(node)}")
        return str(value)

    return read


def _optional(read: Callable[[yaml.Node], object]) -> Callable[[yaml.Node], object]:
    """`null` means "not set": ssh_config or the built-in default decides."""
    return lambda node: None if _plain(node) is None else read(node)


_SETTINGS: dict[str, Callable[[yaml.Node], object]] = {
    "connection": _read_connection,
    "user": _optional(_name_reader("a user name")),
    "port": _optional(_read_port),
    "identity_file": _optional(_read_path),
    "python": _read_path,
    "workdir": _read_path,
    "address": _optional(_name_reader("an address", _ADDRESS_HINTS)),
    "tf_port": _read_port,
    "restart_limit": _read_restart_limit,
    "restart_backoff": _read_seconds,
    "base_python": _read_path,
    "packages": _read_packages,
    "accelerator": _choice(ACCELERATORS),
    "gpus": _optional(_read_gpus),
}
_BUILTIN: dict[str, object] = dict.fromkeys(_SETTINGS) | {
    "connection": "ssh", "python": DEFAULT_PYTHON, "workdir": DEFAULT_WORKDIR, "tf_port": DEFAULT_TF_PORT,
    "restart_limit": DEFAULT_RESTART_LIMIT, "restart_backoff": DEFAULT_RESTART_BACKOFF,
    "base_python": DEFAULT_PYTHON, "packages": (), "accelerator": "none",
}
_MANAGED_ONLY = ("base_python", "packages", "accelerator")  # on a host entry: only with python: managed
_TOP_KEYS = ("cluster", "ssh_config", "network", "firewall", "defaults", "hosts", "slurm", "sync")
# `slurm:`: the allocation (what sbatch gets), the layout per node, and the nodes' own settings.
_SLURM_ALLOCATION: dict[str, Callable[[yaml.Node], object]] = {
    "nodes": _read_nodes, "partition": _name_reader("a partition name"), "time": _read_slurm_time,
    "account": _name_reader("an account name"), "qos": _name_reader("a QOS name"),
    "gpus_per_node": _read_gpus_per_node, "sbatch": _read_sbatch,
}
_NODE_SETTINGS = ("python", "workdir", "tf_port", "restart_limit", "restart_backoff", "base_python",
                  "packages", "accelerator")
_SLURM_KEYS = ("login", "job", *_SLURM_ALLOCATION, "ps", "workers", *_NODE_SETTINGS)
_LOGIN_KEYS = ("host", "user", "port", "identity_file")
_NOT_WITH_SLURM = ("connection", "address", "gpus")  # per host; Slurm decides (gpus: slurm.gpus_per_node)
_SYNC_KEYS = ("path", "as")
_HOST_KEYS = ("host", *_SETTINGS, "ps", "workers")
_PER_HOST_ONLY = {k: "not allowed in defaults: set it in each hosts entry" for k in ("host", "ps", "workers")}

# A role is a count of tasks or explicit ports, each with the node a problem would point at.
# Strings: evaluated, they would load yaml.
_Role: TypeAlias = "int | tuple[tuple[int, yaml.Node], ...]"
# One TF server: (port, path, node to point at) for the duplicate-port check.
_Task: TypeAlias = "tuple[int, str, yaml.Node]"
_Found: TypeAlias = "dict[str, tuple[yaml.Node, yaml.Node]]"  # key name: (key node, value node)


def _key_text(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_.-]+", name) else _short(name)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- the checker: walks the node tree once, collecting every problem ---------------------------


class _Checker:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []
        self.num_ps = self.num_workers = 0
        self.roles_known = True  # False when a bad entry makes the cluster's task count unknown
        self.used: dict[tuple[str, ...], dict[int, tuple[str, int]]] = {}  # machine: port: (path, line)

    def report(self, node: yaml.Node, path: str, message: str) -> None:
        mark = node.start_mark
        self.problems.append(Problem(self.filename, mark.line + 1, mark.column + 1, path, message))

    def entries(
        self, node: yaml.MappingNode, path: str, allowed: tuple[str, ...], misplaced: dict[str, str]
    ) -> _Found:
        """The mapping's known entries by name; unknown, duplicate and non-string keys reported."""
        found: _Found = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag != _STR:
                if key.tag == _MERGE:
                    self.report(key, path, "YAML merge keys (<<) are not supported; use defaults")
                else:
                    self.report(key, path, f"expected a key name, got {_describe(key)}")
                continue
            name, where = key.value, _join(path, _key_text(key.value))
            if name in found:
                first = found[name][0].start_mark.line + 1
                self.report(key, where, f"duplicate key (first given at line {first})")
            elif name in allowed:
                found[name] = (key, value)
            elif name in misplaced:
                self.report(key, where, misplaced[name])
            else:
                close = difflib.get_close_matches(name, allowed, n=1)
                self.report(key, where, "unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return found

    def value(self, entry: tuple[yaml.Node, yaml.Node], path: str, read: Callable[[yaml.Node], Any]) -> Any:
        """`read` the entry's value, or report at the entry's key and return _INVALID."""
        try:
            return read(entry[1])
        except _Invalid as e:
            self.report(entry[0], path, str(e))
            return _INVALID

    def settings(self, found: _Found, path: str, base: dict[str, Any]) -> dict[str, Any]:
        result = dict(base)
        for name, read in _SETTINGS.items():
            if name in found:
                result[name] = self.value(found[name], _join(path, name), read)
        return result

    def inventory(self, root: yaml.Node | None) -> Inventory | None:
        expected = "a mapping with keys cluster and hosts"
        if root is None:
            self.problems.append(Problem(self.filename, 1, 1, "", f"the file is empty; expected {expected}"))
            return None
        if not _is_map(root):
            self.report(root, "", f"expected {expected}, got {_describe(root)}")
            return None
        found = self.entries(root, "", _TOP_KEYS, {})
        for required in ("cluster", "hosts"):
            if required not in found and not (required == "hosts" and "slurm" in found):
                self.report(root, "", f"missing required key {required!r}")
        if "hosts" in found and "slurm" in found:
            self.report(found["slurm"][0], "slurm", "expected hosts or slurm, not both: slurm's nodes are the hosts")
        cluster = self.value(found["cluster"], "cluster", _read_cluster) if "cluster" in found else _INVALID
        ssh_config = None
        if "ssh_config" in found:
            ssh_config = self.value(found["ssh_config"], "ssh_config", _optional(_read_path))
        choices = {}
        for name, options in (("network", NETWORKS), ("firewall", FIREWALLS)):
            if name in found:
                choices[name] = self.value(found[name], name, _choice(options))
        defaults = dict(_BUILTIN)
        if "defaults" in found:
            key, node = found["defaults"]
            if _is_map(node):
                entries = self.entries(node, "defaults", tuple(_SETTINGS), _PER_HOST_ONLY)
                defaults = self.settings(entries, "defaults", defaults)
            elif not (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
                self.report(key, "defaults", f"expected a mapping of host settings, got {_describe(node)}")
        hosts = self.hosts(found["hosts"], defaults) if "hosts" in found else []
        slurm = None
        if "slurm" in found and "hosts" not in found:
            slurm = self.slurm(found["slurm"], defaults, found.get("defaults"))
        sync = self.sync(found["sync"]) if "sync" in found else []
        if self.problems or not isinstance(cluster, str):  # an invalid cluster is one of the problems
            return None
        return Inventory(path=self.filename, cluster=cluster, hosts=tuple(hosts), ssh_config=ssh_config,
                         sync=tuple(sync), slurm=slurm, **choices)

    def slurm(self, entry: tuple[yaml.Node, yaml.Node], defaults: dict[str, Any],
              defaults_entry: tuple[yaml.Node, yaml.Node] | None) -> SlurmSpec | None:
        """`slurm:`: the login host, the allocation (or an existing `job`), the layout per node."""
        key, node = entry
        if not _is_map(node):
            self.report(key, "slurm", f"expected a mapping with login and nodes (or job), got {_describe(node)}")
            return None
        if defaults_entry is not None and _is_map(defaults_entry[1]):
            for k, _ in defaults_entry[1].value:
                if isinstance(k, yaml.ScalarNode) and k.value in _NOT_WITH_SLURM:
                    self.report(k, f"defaults.{k.value}", "not with slurm: Slurm decides where tasks run"
                                + (" (GPUs: slurm.gpus_per_node)" if k.value == "gpus" else ""))
        found = self.entries(node, "slurm", _SLURM_KEYS, {"host": "in slurm.login (the login host)",
                                                          "hosts": "not in slurm: the nodes come from Slurm"})
        login = self.login(found["login"], defaults) if "login" in found else None
        if "login" not in found:
            self.report(node, "slurm", "missing required key 'login'")
        job = self.value(found["job"], "slurm.job", _read_slurm_job) if "job" in found else None
        allocation: dict[str, Any] = {}
        if "job" in found:
            for name in _SLURM_ALLOCATION:
                if name in found:
                    self.report(found[name][0], f"slurm.{name}",
                                "not with job: that allocation is made already (remove one of them)")
        else:
            allocation = {name: self.value(found[name], f"slurm.{name}", read)
                          for name, read in _SLURM_ALLOCATION.items() if name in found}
        if "job" not in found and "nodes" not in found:
            self.report(node, "slurm", "missing required key 'nodes' (or 'job': an allocation you made)")
        s = dict(defaults)
        for name in _NODE_SETTINGS:
            if name in found:
                s[name] = self.value(found[name], f"slurm.{name}", _SETTINGS[name])
        ps, workers = (self.role(found[r], f"slurm.{r}") if r in found else 0 for r in ("ps", "workers"))
        if ps is None or workers is None or login is None or _INVALID in s.values() \
                or _INVALID in allocation.values() or job is _INVALID or self.problems:
            return None
        if s["python"] != MANAGED:
            misplaced = [k for k in _MANAGED_ONLY if k in found]
            for k in misplaced:
                self.report(found[k][0], f"slurm.{k}", f"only for a managed environment (python: {MANAGED}); "
                                                       f"the nodes' python is {s['python']!r}")
            if misplaced:
                return None
        tasks = self.assign_ports("slurm", found, s["tf_port"], ps, workers)
        if tasks is None:
            return None
        self.check_ports({}, "each node", tasks[0] + tasks[1])
        if not tasks[1]:
            self.report(found["workers"][0] if "workers" in found else key, "slurm.workers",
                        "no worker task: each node needs workers: 1 or more")
            return None
        gpus_per_node = allocation.get("gpus_per_node")
        gres = gres_gpus(allocation.get("sbatch", ()))
        if gres is not None and gpus_per_node is not None:
            self.report(found["sbatch"][0], "slurm.sbatch", "a --gres of GPUs and slurm.gpus_per_node: one GPU "
                                                            "request per node (remove one of them)")
            return None
        gpus_per_node = gpus_per_node if gres is None else gres
        node_spec = HostSpec(
            host="", line=node.start_mark.line + 1, connection="slurm", user=None, port=None, identity_file=None,
            python=s["python"], workdir=s["workdir"], address=None,
            ps_ports=tuple(port for port, _, _ in tasks[0]), worker_ports=tuple(port for port, _, _ in tasks[1]),
            restart_limit=s["restart_limit"], restart_backoff=s["restart_backoff"], base_python=s["base_python"],
            packages=s["packages"], accelerator=s["accelerator"],
            gpus=tuple(range(gpus_per_node)) if gpus_per_node else None,
        )
        return SlurmSpec(login=login, node=node_spec, line=key.start_mark.line + 1, job=job, **allocation)

    def login(self, entry: tuple[yaml.Node, yaml.Node], defaults: dict[str, Any]) -> HostSpec | None:
        """`slurm.login`: a host name, or a mapping {host, user, port, identity_file}."""
        node = entry[1]
        path = "slurm.login"
        if _is_map(node):
            found = self.entries(node, path, _LOGIN_KEYS, {})
            if "host" not in found:
                self.report(node, path, "missing required key 'host'")
                return None
            name = self.value(found["host"], f"{path}.host", _name_reader("a host name", _HOST_HINTS))
            s = self.settings({k: v for k, v in found.items() if k != "host"}, path, defaults)
        else:
            name = self.value(entry, path, _name_reader("a host name (or a mapping with host, user, port, "
                                                        "identity_file)", _HOST_HINTS))
            s = dict(defaults)
        if name is _INVALID or _INVALID in s.values():
            return None
        return HostSpec(host=name, line=node.start_mark.line + 1, connection="ssh", user=s["user"], port=s["port"],
                        identity_file=s["identity_file"], python=DEFAULT_PYTHON, workdir=s["workdir"], address=None,
                        ps_ports=(), worker_ports=())

    def sync(self, entry: tuple[yaml.Node, yaml.Node]) -> list[SyncSpec]:
        """`sync:`: a list of paths, or of mappings {path, as}; names unique and plain."""
        from dtf.files.sync import default_name, name_flaw

        key, node = entry
        if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
            return []
        if not _is_seq(node):
            self.report(key, "sync", f"expected a list of paths (or of mappings with path and as), "
                                     f"got {_describe(node)}")
            return []
        specs: list[SyncSpec] = []
        named: dict[str, tuple[str, int]] = {}
        for i, item in enumerate(node.value):
            path = f"sync[{i}]"
            name_node: yaml.Node | None = None
            if _is_map(item):
                found = self.entries(item, path, _SYNC_KEYS, {})
                if "path" not in found:
                    self.report(item, path, "missing required key 'path'")
                    continue
                where = item
                value = self.value(found["path"], f"{path}.path", _read_path)
                if "as" in found:
                    name_node = found["as"][0]
                    name = self.value(found["as"], f"{path}.as",
                                      lambda n: _read_string(n, "a name for dtf.synced(NAME)"))
                else:
                    name = default_name(value) if isinstance(value, str) else _INVALID
            else:
                where = item
                value = self.value((item, item), path, _read_path)
                name = default_name(value) if isinstance(value, str) else _INVALID
            if not isinstance(value, str) or not isinstance(name, str):
                continue
            flaw = name_flaw(name)
            if flaw:
                hint = "" if name_node is not None else " (name it with `as:`)"
                self.report(name_node or where, f"{path}.as" if name_node else path, flaw + hint)
                continue
            if name in named:
                other, line = named[name]
                self.report(name_node or where, path, f"the name {name!r} is already used by {other} "
                                                      f"(line {line}): give one of them another with `as:`")
                continue
            named[name] = (path, where.start_mark.line + 1)
            specs.append(SyncSpec(path=value, name=name, line=where.start_mark.line + 1,
                                  column=where.start_mark.column + 1))
        return specs

    def hosts(self, entry: tuple[yaml.Node, yaml.Node], defaults: dict[str, Any]) -> list[HostSpec]:
        key, node = entry
        if not (_is_seq(node) and node.value):
            self.report(key, "hosts", f"expected a non-empty list of hosts, got {_describe(node)}")
            return []
        specs = [self.host(f"hosts[{i}]", item, defaults) for i, item in enumerate(node.value)]
        # No ps is a cluster for `dtf train --collective` only (MultiWorkerMirroredStrategy); a
        # ParameterServerStrategy run on it is refused by `dtf train`.
        if self.roles_known and self.num_workers == 0:
            self.report(key, "hosts", "no worker task: at least one host needs workers: 1 or more")
        return [spec for spec in specs if spec is not None]

    def host(self, path: str, node: yaml.Node, defaults: dict[str, Any]) -> HostSpec | None:
        """One hosts entry; None if it has problems (reported)."""
        if not _is_map(node):
            self.report(node, path, f"expected a mapping with at least a host key, got {_describe(node)}")
            self.roles_known = False
            return None
        found = self.entries(node, path, _HOST_KEYS, {})
        s = self.settings(found, path, defaults)
        if "host" in found:
            name = self.value(found["host"], f"{path}.host", _name_reader("a host name", _HOST_HINTS))
        else:
            name = _INVALID
            self.report(node, path, "missing required key 'host'")
        ps, workers = (self.role(found[r], f"{path}.{r}") if r in found else 0 for r in ("ps", "workers"))
        if ps is None or workers is None:
            self.roles_known = False
            return None
        num_ps, num_workers = (r if isinstance(r, int) else len(r) for r in (ps, workers))
        self.num_ps += num_ps
        self.num_workers += num_workers
        if num_ps + num_workers > _MAX_TASKS_PER_HOST:  # each is <= the limit, so both keys exist
            message = f"expected at most {_MAX_TASKS_PER_HOST} tasks per host, got {num_ps + num_workers}"
            self.report(found["workers"][0], f"{path}.workers", message)
            return None
        if name is _INVALID or _INVALID in s.values():
            return None
        if s["python"] != MANAGED:  # a user's python is never modified: nothing to install there
            misplaced = [k for k in _MANAGED_ONLY if k in found]
            for key in misplaced:
                self.report(found[key][0], f"{path}.{key}",
                            f"only for a managed environment (python: {MANAGED}); this host's python is "
                            f"{s['python']!r}")
            if misplaced:
                return None
        tasks = self.assign_ports(path, found, s["tf_port"], ps, workers)
        if tasks is None:
            return None
        local = s["connection"] == "local"
        # Every local entry is this machine, whatever its name; host names ignore case.
        machine = ("local",) if local else ("ssh", name.lower())
        where = "the local machine" if local else f"host {name!r}"
        self.check_ports(self.used.setdefault(machine, {}), where, tasks[0] + tasks[1])
        return HostSpec(
            host=name,
            line=node.start_mark.line + 1,
            connection=s["connection"],
            user=None if local else s["user"],  # local tasks are plain processes: no SSH
            port=None if local else s["port"],
            identity_file=None if local else s["identity_file"],
            python=s["python"],
            workdir=s["workdir"],
            address=s["address"],
            ps_ports=tuple(port for port, _, _ in tasks[0]),
            worker_ports=tuple(port for port, _, _ in tasks[1]),
            restart_limit=s["restart_limit"],
            restart_backoff=s["restart_backoff"],
            base_python=s["base_python"],
            packages=s["packages"],
            accelerator=s["accelerator"],
            gpus=s["gpus"],
        )

    def role(self, entry: tuple[yaml.Node, yaml.Node], path: str) -> _Role | None:
        """`ps` or `workers`: a count, or a list of explicit ports (each checked where it stands)."""
        key, node = entry
        try:
            value = _plain(node)
        except _Invalid as e:
            self.report(key, path, str(e))
            return None
        limit = f"expected at most {_MAX_TASKS_PER_HOST} tasks per host"
        if isinstance(value, yaml.SequenceNode):
            if len(value.value) > _MAX_TASKS_PER_HOST:
                self.report(key, path, f"{limit}, got {len(value.value)} ports")
                return None
            # A bad port is reported at the item itself, so the item is also the "key".
            items = enumerate(value.value)
            ports = [(self.value((item, item), f"{path}[{i}]", _read_port), item) for i, item in items]
            return None if any(port is _INVALID for port, _ in ports) else tuple(ports)
        if value is _TOO_BIG or (_is_int(value) and value > _MAX_TASKS_PER_HOST):
            self.report(key, path, f"{limit}, got {_describe(node)}")
            return None
        if not _is_int(value) or value < 0:
            self.report(key, path, f"expected a whole number >= 0 or a list of ports, got {_describe(node)}")
            return None
        return value

    def assign_ports(
        self, path: str, found: _Found, tf_port: int, *roles: _Role
    ) -> tuple[list[_Task], ...] | None:
        """(ps, workers) servers. Counted ports go up from tf_port, ps first, skipping explicit ones."""
        explicit = {port for role in roles if not isinstance(role, int) for port, _ in role}
        result: list[list[_Task]] = []
        next_port = tf_port
        for name, role in zip(("ps", "workers"), roles):
            if not isinstance(role, int):
                result.append([(port, f"{path}.{name}[{i}]", item) for i, (port, item) in enumerate(role)])
                continue
            tasks: list[_Task] = []
            for _ in range(role):
                while next_port in explicit:
                    next_port += 1
                if next_port > 65535:
                    message = f"expected ports 1..65535, but counting up from tf_port {tf_port} reaches 65536"
                    self.report(found[name][0], f"{path}.{name}", message)
                    return None
                tasks.append((next_port, f"{path}.{name}", found[name][0]))
                next_port += 1
            result.append(tasks)
        return tuple(result)

    def check_ports(self, used: dict[int, tuple[str, int]], where: str, tasks: list[_Task]) -> None:
        """Two TF servers on one machine cannot share a port, even from two entries for one host."""
        reported: set[str] = set()
        for port, path, node in tasks:
            if port in used and path not in reported:
                other, line = used[port]
                self.report(node, path, f"port {port} on {where} is already used by {other} (line {line})")
                reported.add(path)  # one problem per counted role is enough
            used.setdefault(port, (path, node.start_mark.line + 1))
