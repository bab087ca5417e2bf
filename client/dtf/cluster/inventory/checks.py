"""The inventory's rules: which keys go where, what each holds, and what must hold across entries
(a worker somewhere, no port used twice on one machine, slurm or hosts).

`Checker` walks the composed YAML nodes once and collects every problem with its file:line:column;
where it finds none, it builds the `Inventory`, with the position of each of its values.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import Any, TypeAlias

import yaml

from dtf.cluster.inventory.model import (
    DEFAULT_PYTHON,
    MANAGED,
    NETWORKS,
    HostSpec,
    Inventory,
    Position,
    SlurmSpec,
    SyncSpec,
)
from dtf.cluster.inventory.values import (
    BUILTIN,
    HOST_HINTS,
    INVALID,
    MAX_TASKS_PER_HOST,
    MERGE,
    NULL,
    SETTINGS,
    SLURM_ALLOCATION,
    STR,
    TOO_BIG,
    Invalid,
    choice,
    describe,
    gres_gpus,
    is_int,
    is_map,
    is_seq,
    name_reader,
    optional,
    plain,
    read_cluster,
    read_firewall,
    read_host_timeout,
    read_path,
    read_port,
    read_slurm_job,
    read_string,
    short,
)
from dtf.errors import Problem

_MANAGED_ONLY = ("base_python", "packages", "accelerator")  # on a host entry: only with python: managed
_TOP_KEYS = ("cluster", "ssh_config", "network", "firewall", "defaults", "hosts", "slurm", "sync", "spares",
             "host_timeout", "coordinator")
# `slurm:`: besides the allocation, the layout per node and the nodes' own settings.
_NODE_SETTINGS = ("python", "workdir", "tf_port", "restart_limit", "restart_backoff", "base_python",
                  "packages", "accelerator")
_SLURM_KEYS = ("login", "job", *SLURM_ALLOCATION, "ps", "workers", *_NODE_SETTINGS)
_LOGIN_KEYS = ("host", "user", "port", "identity_file")
_NOT_WITH_SLURM = ("connection", "address", "gpus")  # per host; Slurm decides (gpus: slurm.gpus_per_node)
_SYNC_KEYS = ("path", "as")
_HOST_KEYS = ("host", *SETTINGS, "ps", "workers")
# A spare: a hosts entry without tasks (it takes over a lost host's, on their ports).
_SPARE_KEYS = tuple(k for k in _HOST_KEYS if k not in ("ps", "workers", "tf_port", "connection"))
_NOT_ON_A_SPARE = {"ps": "not on a spare: it takes over the tasks of a lost host, on their ports",
                   "workers": "not on a spare: it takes over the tasks of a lost host, on their ports",
                   "tf_port": "not on a spare: it takes over the tasks of a lost host, on their ports",
                   "connection": "not on a spare: a spare is another machine, reached by SSH"}
_PER_HOST_ONLY = {k: "not allowed in defaults: set it in each hosts entry" for k in ("host", "ps", "workers")}

# A role is a count of tasks or explicit ports, each with the node a problem would point at.
_Role: TypeAlias = int | tuple[tuple[int, yaml.Node], ...]
# One TF server: (port, path, node to point at) for the duplicate-port check.
_Task: TypeAlias = tuple[int, str, yaml.Node]
_Found: TypeAlias = dict[str, tuple[yaml.Node, yaml.Node]]  # key name: (key node, value node)


def _key_text(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_.-]+", name) else short(name)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# -- the checker: walks the node tree once, collecting every problem ---------------------------


class Checker:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[Problem] = []
        self.num_ps = self.num_workers = 0
        self.roles_known = True  # False when a bad entry makes the cluster's task count unknown
        self.used: dict[tuple[str, ...], dict[int, tuple[str, int]]] = {}  # machine: port: (path, line)
        self.positions: dict[str, Position] = {}  # Inventory.positions

    def position(self, node: yaml.Node) -> Position:
        mark = node.start_mark
        return Position(self.filename, mark.line + 1, mark.column + 1)

    def report(self, node: yaml.Node, path: str, message: str) -> None:
        at = self.position(node)
        self.problems.append(Problem(at.file, at.line, at.column, path, message))

    def entries(
        self, node: yaml.MappingNode, path: str, allowed: tuple[str, ...], misplaced: dict[str, str]
    ) -> _Found:
        """The mapping's known entries by name; unknown, duplicate and non-string keys reported."""
        found: _Found = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag != STR:
                if key.tag == MERGE:
                    self.report(key, path, "YAML merge keys (<<) are not supported; use defaults")
                else:
                    self.report(key, path, f"expected a key name, got {describe(key)}")
                continue
            name, where = key.value, _join(path, _key_text(key.value))
            if name in found:
                first = found[name][0].start_mark.line + 1
                self.report(key, where, f"duplicate key (first given at line {first})")
            elif name in allowed:
                found[name] = (key, value)
                self.positions[where] = self.position(key)
            elif name in misplaced:
                self.report(key, where, misplaced[name])
            else:
                close = difflib.get_close_matches(name, allowed, n=1)
                self.report(key, where, "unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return found

    def value(self, entry: tuple[yaml.Node, yaml.Node], path: str, read: Callable[[yaml.Node], Any]) -> Any:
        """`read` the entry's value, or report at the entry's key and return INVALID."""
        try:
            return read(entry[1])
        except Invalid as e:
            self.report(entry[0], path, str(e))
            return INVALID

    def settings(self, found: _Found, path: str, base: dict[str, Any]) -> dict[str, Any]:
        result = dict(base)
        for name, read in SETTINGS.items():
            if name in found:
                result[name] = self.value(found[name], _join(path, name), read)
        return result

    def inventory(self, root: yaml.Node | None) -> Inventory | None:
        expected = "a mapping with keys cluster and hosts"
        if root is None:
            self.problems.append(Problem(self.filename, 1, 1, "", f"the file is empty; expected {expected}"))
            return None
        if not is_map(root):
            self.report(root, "", f"expected {expected}, got {describe(root)}")
            return None
        found = self.entries(root, "", _TOP_KEYS, {})
        for required in ("cluster", "hosts"):
            if required not in found and not (required == "hosts" and "slurm" in found):
                self.report(root, "", f"missing required key {required!r}")
        if "hosts" in found and "slurm" in found:
            self.report(found["slurm"][0], "slurm", "expected hosts or slurm, not both: slurm's nodes are the hosts")
        cluster = self.value(found["cluster"], "cluster", read_cluster) if "cluster" in found else INVALID
        ssh_config = None
        if "ssh_config" in found:
            ssh_config = self.value(found["ssh_config"], "ssh_config", optional(read_path))
        choices = {}
        if "network" in found:
            choices["network"] = self.value(found["network"], "network", choice(NETWORKS))
        if "firewall" in found:
            choices["firewall"] = self.value(found["firewall"], "firewall", read_firewall)
        defaults = dict(BUILTIN)
        if "defaults" in found:
            key, node = found["defaults"]
            if is_map(node):
                entries = self.entries(node, "defaults", tuple(SETTINGS), _PER_HOST_ONLY)
                defaults = self.settings(entries, "defaults", defaults)
            elif not (isinstance(node, yaml.ScalarNode) and node.tag == NULL):
                self.report(key, "defaults", f"expected a mapping of host settings, got {describe(node)}")
        hosts = self.hosts(found["hosts"], defaults) if "hosts" in found else []
        slurm = None
        if "slurm" in found and "hosts" not in found:
            slurm = self.slurm(found["slurm"], defaults, found.get("defaults"))
        sync = self.sync(found["sync"]) if "sync" in found else []
        spares: list[HostSpec] = []
        if "spares" in found:
            if "slurm" in found:
                self.report(found["spares"][0], "spares", "not with slurm: Slurm decides where tasks run")
            else:
                spares = self.spares(found["spares"], defaults, hosts)
        timeout: dict[str, Any] = {}
        if "host_timeout" in found:
            timeout["host_timeout"] = self.value(found["host_timeout"], "host_timeout", read_host_timeout)
        coordinator = None
        if "coordinator" in found:
            coordinator = self.coordinator(found["coordinator"], hosts, "slurm" in found)
        if self.problems or not isinstance(cluster, str):  # an invalid cluster is one of the problems
            return None
        return Inventory(path=self.filename, cluster=cluster, hosts=tuple(hosts), ssh_config=ssh_config,
                         sync=tuple(sync), slurm=slurm, spares=tuple(spares), positions=self.positions,
                         coordinator=coordinator, **choices, **timeout)

    def coordinator(self, entry: tuple[yaml.Node, yaml.Node], hosts: list[HostSpec], slurm: bool) -> str | None:
        """`coordinator:`: the host a detached run's coordinator runs on (`dtf train --detach`),
        one of the hosts, as the hosts entry spells it."""
        key, node = entry
        if slurm:
            self.report(key, "coordinator", "not with slurm: a detached run's coordinator is a job step on the "
                                            "allocation's first node")
            return None
        name = self.value(entry, "coordinator", name_reader("a host name", HOST_HINTS))
        if name is INVALID:
            return None
        found = next((h.host for h in hosts if h.host.lower() == name.lower()), None)
        if found is None and hosts:
            self.report(node, "coordinator", f"{name!r} is not one of the hosts (a spare is not: the coordinator "
                                             f"runs on a host of the cluster)")
        return found

    def spares(self, entry: tuple[yaml.Node, yaml.Node], defaults: dict[str, Any],
               hosts: list[HostSpec]) -> list[HostSpec]:
        """`spares:`: hosts that stand by, each a hosts entry without tasks; none is also a host."""
        key, node = entry
        if isinstance(node, yaml.ScalarNode) and node.tag == NULL:
            return []
        if not is_seq(node):
            self.report(key, "spares", f"expected a list of hosts (each as a hosts entry without ps and "
                                       f"workers), got {describe(node)}")
            return []
        taken = {h.host.lower(): h.line for h in hosts}
        specs: list[HostSpec] = []
        for i, item in enumerate(node.value):
            path = f"spares[{i}]"
            self.positions[path] = self.position(item)
            if not is_map(item):
                self.report(item, path, f"expected a mapping with at least a host key, got {describe(item)}")
                continue
            found = self.entries(item, path, _SPARE_KEYS, _NOT_ON_A_SPARE)
            s = self.settings(found, path, defaults)
            if "host" not in found:
                self.report(item, path, "missing required key 'host'")
                continue
            name = self.value(found["host"], f"{path}.host", name_reader("a host name", HOST_HINTS))
            if name is INVALID or INVALID in s.values():
                continue
            line = item.start_mark.line + 1
            if name.lower() in taken:
                first = taken[name.lower()]
                what = "a spare already" if first < 0 else f"in hosts already (line {first})"
                self.report(found["host"][1], f"{path}.host", f"host {name!r} is {what}: a spare stands by "
                                                               f"for the hosts, apart from them")
                continue
            taken[name.lower()] = -line
            specs.append(HostSpec(
                host=name, line=line, connection="ssh", user=s["user"], port=s["port"],
                identity_file=s["identity_file"], python=s["python"], workdir=s["workdir"], address=s["address"],
                ps_ports=(), worker_ports=(), restart_limit=s["restart_limit"],
                restart_backoff=s["restart_backoff"], base_python=s["base_python"], packages=s["packages"],
                accelerator=s["accelerator"], gpus=s["gpus"]))
        return specs

    def slurm(self, entry: tuple[yaml.Node, yaml.Node], defaults: dict[str, Any],
              defaults_entry: tuple[yaml.Node, yaml.Node] | None) -> SlurmSpec | None:
        """`slurm:`: the login host, the allocation (or an existing `job`), the layout per node."""
        key, node = entry
        if not is_map(node):
            self.report(key, "slurm", f"expected a mapping with login and nodes (or job), got {describe(node)}")
            return None
        if defaults_entry is not None and is_map(defaults_entry[1]):
            for k, _ in defaults_entry[1].value:
                if isinstance(k, yaml.ScalarNode) and k.value in _NOT_WITH_SLURM:
                    self.report(k, f"defaults.{k.value}", "not with slurm: Slurm decides where tasks run"
                                + (" (GPUs: slurm.gpus_per_node)" if k.value == "gpus" else ""))
        found = self.entries(node, "slurm", _SLURM_KEYS, {"host": "in slurm.login (the login host)",
                                                          "hosts": "not in slurm: the nodes come from Slurm"})
        login = self.login(found["login"], defaults) if "login" in found else None
        if "login" not in found:
            self.report(node, "slurm", "missing required key 'login'")
        job = self.value(found["job"], "slurm.job", read_slurm_job) if "job" in found else None
        allocation: dict[str, Any] = {}
        if "job" in found:
            for name in SLURM_ALLOCATION:
                if name in found:
                    self.report(found[name][0], f"slurm.{name}",
                                "not with job: that allocation is made already (remove one of them)")
        else:
            allocation = {name: self.value(found[name], f"slurm.{name}", read)
                          for name, read in SLURM_ALLOCATION.items() if name in found}
        if "job" not in found and "nodes" not in found:
            self.report(node, "slurm", "missing required key 'nodes' (or 'job': an allocation you made)")
        s = dict(defaults)
        for name in _NODE_SETTINGS:
            if name in found:
                s[name] = self.value(found[name], f"slurm.{name}", SETTINGS[name])
        ps, workers = (self.role(found[r], f"slurm.{r}") if r in found else 0 for r in ("ps", "workers"))
        if ps is None or workers is None or login is None or INVALID in s.values() \
                or INVALID in allocation.values() or job is INVALID or self.problems:
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
        if is_map(node):
            found = self.entries(node, path, _LOGIN_KEYS, {})
            if "host" not in found:
                self.report(node, path, "missing required key 'host'")
                return None
            name = self.value(found["host"], f"{path}.host", name_reader("a host name", HOST_HINTS))
            s = self.settings({k: v for k, v in found.items() if k != "host"}, path, defaults)
        else:
            name = self.value(entry, path, name_reader("a host name (or a mapping with host, user, port, "
                                                        "identity_file)", HOST_HINTS))
            s = dict(defaults)
        if name is INVALID or INVALID in s.values():
            return None
        return HostSpec(host=name, line=node.start_mark.line + 1, connection="ssh", user=s["user"], port=s["port"],
                        identity_file=s["identity_file"], python=DEFAULT_PYTHON, workdir=s["workdir"], address=None,
                        ps_ports=(), worker_ports=())

    def sync(self, entry: tuple[yaml.Node, yaml.Node]) -> list[SyncSpec]:
        """`sync:`: a list of paths, or of mappings {path, as}; names unique and plain."""
        from dtf.files.sync import default_name, name_flaw

        key, node = entry
        if isinstance(node, yaml.ScalarNode) and node.tag == NULL:
            return []
        if not is_seq(node):
            self.report(key, "sync", f"expected a list of paths (or of mappings with path and as), "
                                     f"got {describe(node)}")
            return []
        specs: list[SyncSpec] = []
        named: dict[str, tuple[str, int]] = {}
        for i, item in enumerate(node.value):
            path = f"sync[{i}]"
            self.positions[path] = self.position(item)
            name_node: yaml.Node | None = None
            if is_map(item):
                found = self.entries(item, path, _SYNC_KEYS, {})
                if "path" not in found:
                    self.report(item, path, "missing required key 'path'")
                    continue
                where = item
                value = self.value(found["path"], f"{path}.path", read_path)
                if "as" in found:
                    name_node = found["as"][0]
                    name = self.value(found["as"], f"{path}.as",
                                      lambda n: read_string(n, "a name for dtf.synced(NAME)"))
                else:
                    name = default_name(value) if isinstance(value, str) else INVALID
            else:
                where = item
                value = self.value((item, item), path, read_path)
                name = default_name(value) if isinstance(value, str) else INVALID
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
        if not (is_seq(node) and node.value):
            self.report(key, "hosts", f"expected a non-empty list of hosts, got {describe(node)}")
            return []
        specs = [self.host(f"hosts[{i}]", item, defaults) for i, item in enumerate(node.value)]
        # No ps is a cluster for `dtf train --collective` only (MultiWorkerMirroredStrategy); a
        # ParameterServerStrategy run on it is refused by `dtf train`.
        if self.roles_known and self.num_workers == 0:
            self.report(key, "hosts", "no worker task: at least one host needs workers: 1 or more")
        return [spec for spec in specs if spec is not None]

    def host(self, path: str, node: yaml.Node, defaults: dict[str, Any]) -> HostSpec | None:
        """One hosts entry; None if it has problems (reported)."""
        self.positions[path] = self.position(node)
        if not is_map(node):
            self.report(node, path, f"expected a mapping with at least a host key, got {describe(node)}")
            self.roles_known = False
            return None
        found = self.entries(node, path, _HOST_KEYS, {})
        s = self.settings(found, path, defaults)
        if "host" in found:
            name = self.value(found["host"], f"{path}.host", name_reader("a host name", HOST_HINTS))
        else:
            name = INVALID
            self.report(node, path, "missing required key 'host'")
        ps, workers = (self.role(found[r], f"{path}.{r}") if r in found else 0 for r in ("ps", "workers"))
        if ps is None or workers is None:
            self.roles_known = False
            return None
        num_ps, num_workers = (r if isinstance(r, int) else len(r) for r in (ps, workers))
        self.num_ps += num_ps
        self.num_workers += num_workers
        if num_ps + num_workers > MAX_TASKS_PER_HOST:  # each is <= the limit, so both keys exist
            message = f"expected at most {MAX_TASKS_PER_HOST} tasks per host, got {num_ps + num_workers}"
            self.report(found["workers"][0], f"{path}.workers", message)
            return None
        if name is INVALID or INVALID in s.values():
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
            value = plain(node)
        except Invalid as e:
            self.report(key, path, str(e))
            return None
        limit = f"expected at most {MAX_TASKS_PER_HOST} tasks per host"
        if isinstance(value, yaml.SequenceNode):
            if len(value.value) > MAX_TASKS_PER_HOST:
                self.report(key, path, f"{limit}, got {len(value.value)} ports")
                return None
            # A bad port is reported at the item itself, so the item is also the "key".
            items = enumerate(value.value)
            self.positions.update((f"{path}[{i}]", self.position(item)) for i, item in enumerate(value.value))
            ports = [(self.value((item, item), f"{path}[{i}]", read_port), item) for i, item in items]
            return None if any(port is INVALID for port, _ in ports) else tuple(ports)
        if value is TOO_BIG or (is_int(value) and value > MAX_TASKS_PER_HOST):
            self.report(key, path, f"{limit}, got {describe(node)}")
            return None
        if not is_int(value) or value < 0:
            self.report(key, path, f"expected a whole number >= 0 or a list of ports, got {describe(node)}")
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
