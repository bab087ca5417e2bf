"""The TF ports' firewall rules (`firewall: auto` and `members`): the ports of one cluster accept
connections only from its hosts, loopback, and the laptop where it reaches them directly.

A TensorFlow server runs any graph anyone who reaches its port sends it, and it always listens on
0.0.0.0 (tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc: `AddListeningPort("0.0.0.0:"
+ port)`; nothing binds it to one interface). The rules are a table of their own (nftables) or a
chain of their own (iptables, when the host has no `nft`), named after the cluster's directory,
so that they never touch the host's other rules and are removed exactly: by `clean` (`dtf down`,
a failed `up`'s rollback), by the last task when the lease lapses, and by the next start on the
host when their cluster is gone (`sweep`, once that start's servers are on their way: a
supervisor killed with SIGKILL removes nothing).

Every rule set is tagged (a comment on its reject rule) with the user that set it and its
cluster's directory, so that a later start finds the stale ones. What was set is remembered in
ROOT/firewall.json. Needs root, or passwordless sudo for the rule tool (`sudo -n`).

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import re
import shlex
import shutil
import socket
import subprocess
import urllib.parse
from collections.abc import Callable

from dtf_server.procs import read_json, write_json
from dtf_server.protocol import FirewallReply, Layout

TIMEOUT = 20.0
TOOLS_ENV = "DTF_FIREWALL_TOOLS"  # which tools to try, in order (a host's python wrapper may set it)
TAG = "dtf uid="  # how every rule set's comment begins: "dtf uid=UID root=ROOT" (ROOT %-quoted)
TAG_MAX = 120  # characters a comment holds (nft's limit is 128); a longer root is left out ("-")
_TAG_RE = re.compile(r"dtf uid=(\d+) root=([^\s\"]+)")


def rules_name(root: str) -> str:
    return "dtf_" + hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:10]


def chain_name(name: str) -> str:
    """The iptables chain of the rules named `name` (iptables' names are upper case by custom)."""
    return name.upper().replace("_", "-")


def tag(root: str) -> str:
    """The comment that marks this user's rules for the cluster directory `root`."""
    text = f"{TAG}{os.geteuid()} root={urllib.parse.quote(os.path.realpath(root), safe='/._-~+')}"
    return text if len(text) <= TAG_MAX else f"{TAG}{os.geteuid()} root=-"


def _binary(tool: str) -> str | None:
    """Where `tool` is: on PATH, or in the sbin directories a non-root PATH often lacks."""
    found = shutil.which(tool)
    if found:
        return found
    return next((p for d in ("/usr/sbin", "/sbin") if os.access(p := os.path.join(d, tool), os.X_OK)), None)


def _privileged(binary: str) -> tuple[list[str], str | None]:
    """The prefix that runs `binary` as root here, or why there is none."""
    if os.geteuid() == 0:
        return [], None
    if shutil.which("sudo") is None:
        return [], "needs root or passwordless sudo, and sudo is not installed"
    # -n: never prompt; -k: a password typed lately (sudo's cached credentials) does not count,
    # as it would not when the rules are removed; -l: may this user run it (nothing runs).
    sudo = ["sudo", "-k", "-n"]
    try:
        ok = subprocess.run([*sudo, "-l", binary], capture_output=True, timeout=TIMEOUT).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (sudo, None) if ok else ([], f"needs root or passwordless sudo for {binary} "
                                        "(sudo -n asks for a password)")


def _tool() -> str | None:
    """The first of the tools to try (DTF_FIREWALL_TOOLS, default nft then iptables) found here."""
    tools = os.environ.get(TOOLS_ENV, "nft,iptables").split(",")
    return next((t for t in tools if t in ("nft", "iptables") and _binary(t)), None)


def _addresses(names: list[str]) -> list[str]:
    """Every IP address the members' names and addresses stand for (resolved here)."""
    found: list[str] = []
    for name in names:
        try:
            infos = socket.getaddrinfo(name.strip("[]"), None, proto=socket.IPPROTO_TCP)
        except OSError:
            continue
        for info in infos:
            address = str(info[4][0]).split("%")[0]
            if address not in found:
                found.append(address)
    return found


def _run(argv: list[str], stdin: str | None = None) -> str | None:
    """None when it worked, else the error's last line."""
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"{argv[0]} exited {r.returncode}"


def _output(argv: list[str]) -> str:
    """The command's stdout ("" when it failed)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout if r.returncode == 0 else ""


def nft_script(name: str, ports: list[int], v4: list[str], v6: list[str], comment: str = "") -> str:
    """The table, replacing any of that name in the same transaction (a restart on the host leaves
    no moment without rules)."""
    dports = "{ " + ", ".join(map(str, ports)) + " }"
    lines = [f"table inet {name} {{}}", f"delete table inet {name}",
             f"table inet {name} {{", "  chain input {",
             "    type filter hook input priority filter - 1; policy accept;",
             f"    iif \"lo\" tcp dport {dports} accept"]
    if v4:
        lines.append(f"    ip saddr {{ {', '.join(v4)} }} tcp dport {dports} accept")
    if v6:
        lines.append(f"    ip6 saddr {{ {', '.join(v6)} }} tcp dport {dports} accept")
    said = f" comment \"{comment}\"" if comment else ""
    lines += [f"    tcp dport {dports} reject with tcp reset{said}", "  }", "}"]
    return "\n".join(lines) + "\n"


def iptables_commands(tool: str, name: str, ports: list[int], members: list[str], comment: str = ""
                      ) -> list[list[str]]:
    chain = chain_name(name)
    cmds = [[tool, "-N", chain], [tool, "-A", chain, "-i", "lo", "-j", "ACCEPT"]]
    cmds += [[tool, "-A", chain, "-s", m, "-j", "ACCEPT"] for m in members]
    said = ["-m", "comment", "--comment", comment] if comment else []
    cmds.append([tool, "-A", chain, "-p", "tcp", *said, "-j", "REJECT", "--reject-with", "tcp-reset"])
    for i in range(0, len(ports), 15):  # multiport takes at most 15 ports
        cmds.append([tool, "-I", "INPUT", "-p", "tcp", "-m", "multiport", "--dports",
                     ",".join(map(str, ports[i:i + 15])), "-j", chain])
    return cmds


def apply(root: str, ports: list[int], allow: list[str]) -> FirewallReply:
    """Allow the TF `ports` only from `allow` (names or addresses) and loopback, in place of this
    cluster's earlier rules."""
    tool = _tool()
    if tool is None:
        return FirewallReply(tool=None, error="neither nft nor iptables is installed")
    binary = str(_binary(tool))
    sudo, why = _privileged(binary)
    if why:
        return FirewallReply(tool=None, error=why)
    name = rules_name(root)
    old = read_json(os.path.join(root, Layout.FIREWALL))
    if old and not (old.get("tool") == tool == "nft" and old.get("name") == name):
        remove(root)  # (an nft table of the same name is replaced in one transaction below)
    members = _addresses(allow)
    v4 = [a for a in members if ipaddress.ip_address(a).version == 4]
    v6 = [a for a in members if ipaddress.ip_address(a).version == 6]
    # Remembered first: whatever part of it gets set is removed again.
    write_json(os.path.join(root, Layout.FIREWALL), {"tool": tool, "name": name, "ports": ports})
    comment = tag(root)
    if tool == "nft":
        error = _run([*sudo, binary, "-f", "-"], stdin=nft_script(name, ports, v4, v6, comment))
    else:
        error = None
        for family, addrs in (("iptables", v4), ("ip6tables", v6)):
            found = _binary(family)
            if found is None:  # no ip6tables: IPv4 only
                continue
            for argv in iptables_commands(found, name, ports, addrs, comment):
                error = error or _run([*sudo, *argv])
    if error:
        remove(root)
        return FirewallReply(tool=None, error=f"{tool}: {error}")
    return FirewallReply(tool=tool)


def _drop(tool: str, sudo: list[str], name: str) -> None:
    """Remove the rule set `name` (nft's table, or iptables' chain and the INPUT rules that jump to it)."""
    if tool == "nft":
        _run([*sudo, str(_binary("nft")), "delete", "table", "inet", name])
        return
    chain = chain_name(name)
    for family in ("iptables", "ip6tables"):
        binary = _binary(family)
        if binary is None:
            continue
        for line in _output([*sudo, binary, "-S", "INPUT"]).splitlines():
            words = shlex.split(line)
            if words[:2] == ["-A", "INPUT"] and words[-2:] == ["-j", chain]:
                _run([*sudo, binary, "-D", *words[1:]])
        _run([*sudo, binary, "-F", chain])
        _run([*sudo, binary, "-X", chain])


# Where a dtf before protocol 15 recorded its rules: a cluster it started, taken down by this one.
EARLIER = "fence.json"


def remove(root: str) -> FirewallReply:
    """Remove the rules `apply` set for this cluster directory (nothing if there are none)."""
    path = os.path.join(root, Layout.FIREWALL)
    if not os.path.exists(path) and os.path.exists(os.path.join(root, EARLIER)):
        os.replace(os.path.join(root, EARLIER), path)
    data = read_json(path)
    if not data:
        return FirewallReply(tool=None)
    tool = str(data.get("tool"))
    binary = _binary("nft" if tool == "nft" else "iptables")
    if binary is None:  # (gone since: no rules of it either)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return FirewallReply(tool=None)
    sudo, why = _privileged(binary)
    if why:
        return FirewallReply(tool=None, error=why)
    _drop(tool, sudo, str(data.get("name")))
    with contextlib.suppress(OSError):  # (a sweep of another start may have removed it)
        os.unlink(path)
    return FirewallReply(tool=None)


def nft_tags(ruleset: str) -> dict[str, tuple[int, str]]:
    """The dtf tables in `nft list ruleset`'s output: name -> (uid, cluster directory; "" where
    the directory was too long to be told)."""
    found: dict[str, tuple[int, str]] = {}
    table = None
    for line in ruleset.splitlines():
        head = re.match(r"table inet (dtf_[0-9a-f]+) \{", line)
        if head or line.startswith("table "):
            table = head.group(1) if head else None
        elif table and (m := _TAG_RE.search(line)):
            found[table] = (int(m.group(1)), "" if m.group(2) == "-" else urllib.parse.unquote(m.group(2)))
    return found


def iptables_tags(rules: str) -> dict[str, tuple[int, str]]:
    """The dtf chains in `iptables -S`'s output, by the name of their rules (as `nft_tags`)."""
    found: dict[str, tuple[int, str]] = {}
    for line in rules.splitlines():
        m = _TAG_RE.search(line)
        words = line.split()
        if m and words[:1] == ["-A"] and words[1].startswith("DTF-"):
            found[words[1].lower().replace("-", "_")] = (
                int(m.group(1)), "" if m.group(2) == "-" else urllib.parse.unquote(m.group(2)))
    return found


def tagged(tool: str, sudo: list[str]) -> dict[str, tuple[int, str]]:
    """Every dtf rule set here: its name -> (the uid that set it, its cluster's directory)."""
    if tool == "nft":
        return nft_tags(_output([*sudo, str(_binary("nft")), "list", "ruleset"]))
    found: dict[str, tuple[int, str]] = {}
    for family in ("iptables", "ip6tables"):
        binary = _binary(family)
        if binary:
            found.update(iptables_tags(_output([*sudo, binary, "-S"])))
    return found


def sweep(root: str, alive: Callable[[str], bool]) -> list[str]:
    """After `apply` set this cluster's rules (with the same tool): remove this user's rule sets
    whose cluster is gone (`alive(root)` False), left by supervisors killed with SIGKILL or on a
    host that lost the cluster's directory. The names removed."""
    data = read_json(os.path.join(root, Layout.FIREWALL)) or {}
    tool, keep = str(data.get("tool")), str(data.get("name"))
    binary = _binary("nft" if tool == "nft" else "iptables")
    if binary is None:
        return []
    sudo, why = _privileged(binary)
    if why:
        return []
    gone = {name: root for name, (uid, root) in tagged(tool, sudo).items()
            if name != keep and uid == os.geteuid() and root and not alive(root)}
    for name, root in gone.items():
        _drop(tool, sudo, name)
        record = os.path.join(root, Layout.FIREWALL)
        if (read_json(record) or {}).get("name") == name:
            with contextlib.suppress(OSError):  # (its `clean` may be removing it too)
                os.unlink(record)
    return list(gone)
