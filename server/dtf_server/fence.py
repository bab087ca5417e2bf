"""`firewall: members`: the TF ports of one cluster accept connections only from its hosts and loopback.

A TensorFlow server runs any graph anyone who reaches its port sends it, and it always listens on
0.0.0.0 (tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc). The rules are a table of
their own (nftables) or a chain of their own (iptables, when the host has no `nft`), named after
the cluster's directory, so that they are removed exactly: by `clean` (`dtf down`), and by the
last task when the lease lapses. What was set is remembered in ROOT/fence.json. Needs root, or passwordless sudo.

Standard library only: this module ships to hosts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import socket
import subprocess

from dtf_server import layout
from dtf_server.procs import read_json, write_json
from dtf_server.protocol import FenceReply

TIMEOUT = 20.0
TOOLS_ENV = "DTF_FIREWALL_TOOLS"  # which tools to try, in order (a host's python wrapper may set it)


def rules_name(root: str) -> str:
    return "dtf_" + hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:10]


def _privileged() -> tuple[list[str], str | None]:
    """The prefix that runs a command as root here, or why there is none."""
    if os.geteuid() == 0:
        return [], None
    if shutil.which("sudo") is None:
        return [], "needs root or passwordless sudo, and sudo is not installed"
    try:
        ok = subprocess.run(["sudo", "-n", "true"], capture_output=True, timeout=TIMEOUT).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (["sudo", "-n"], None) if ok else ([], "needs root or passwordless sudo (sudo -n asks for a password)")


def _binary(tool: str) -> str | None:
    """Where `tool` is: on PATH, or in the sbin directories a non-root PATH often lacks."""
    found = shutil.which(tool)
    if found:
        return found
    return next((p for d in ("/usr/sbin", "/sbin") if os.access(p := os.path.join(d, tool), os.X_OK)), None)


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


def nft_script(name: str, ports: list[int], v4: list[str], v6: list[str]) -> str:
    dports = "{ " + ", ".join(map(str, ports)) + " }"
    lines = [f"table inet {name} {{", "  chain input {",
             "    type filter hook input priority filter - 1; policy accept;",
             f"    iif \"lo\" tcp dport {dports} accept"]
    if v4:
        lines.append(f"    ip saddr {{ {', '.join(v4)} }} tcp dport {dports} accept")
    if v6:
        lines.append(f"    ip6 saddr {{ {', '.join(v6)} }} tcp dport {dports} accept")
    lines += [f"    tcp dport {dports} reject with tcp reset", "  }", "}"]
    return "\n".join(lines) + "\n"


def iptables_commands(tool: str, name: str, ports: list[int], members: list[str]) -> list[list[str]]:
    chain = name.upper().replace("_", "-")
    cmds = [[tool, "-N", chain], [tool, "-A", chain, "-i", "lo", "-j", "ACCEPT"]]
    cmds += [[tool, "-A", chain, "-s", m, "-j", "ACCEPT"] for m in members]
    cmds.append([tool, "-A", chain, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"])
    for i in range(0, len(ports), 15):  # multiport takes at most 15 ports
        cmds.append([tool, "-I", "INPUT", "-p", "tcp", "-m", "multiport", "--dports",
                     ",".join(map(str, ports[i:i + 15])), "-j", chain])
    return cmds


def apply(root: str, ports: list[int], allow: list[str]) -> FenceReply:
    """Allow the TF `ports` only from `allow` (names or addresses) and loopback."""
    sudo, why = _privileged()
    if why:
        return FenceReply(tool=None, error=why)
    tool = _tool()
    if tool is None:
        return FenceReply(tool=None, error="neither nft nor iptables is installed")
    remove(root)  # rules of an earlier start of this cluster
    name = rules_name(root)
    members = _addresses(allow)
    v4 = [a for a in members if ipaddress.ip_address(a).version == 4]
    v6 = [a for a in members if ipaddress.ip_address(a).version == 6]
    # Remembered first: whatever part of it gets set is removed again.
    write_json(os.path.join(root, layout.FENCE), {"tool": tool, "name": name, "ports": ports})
    if tool == "nft":
        error = _run([*sudo, str(_binary("nft")), "-f", "-"], stdin=nft_script(name, ports, v4, v6))
    else:
        error = None
        for family, addrs in (("iptables", v4), ("ip6tables", v6)):
            binary = _binary(family)
            if binary is None:  # no ip6tables: IPv4 only
                continue
            for argv in iptables_commands(binary, name, ports, addrs):
                error = error or _run([*sudo, *argv])
    if error:
        remove(root)
        return FenceReply(tool=None, error=f"{tool}: {error}")
    return FenceReply(tool=tool)


def remove(root: str) -> FenceReply:
    """Remove the rules `apply` set for this cluster directory (nothing if there are none)."""
    path = os.path.join(root, layout.FENCE)
    data = read_json(path)
    if not data:
        return FenceReply(tool=None)
    sudo, why = _privileged()
    if why:
        return FenceReply(tool=None, error=why)
    tool, name = str(data.get("tool")), str(data.get("name"))
    if tool == "nft":
        _run([*sudo, str(_binary("nft")), "delete", "table", "inet", name])
    else:
        chain = name.upper().replace("_", "-")
        ports = [int(p) for p in data.get("ports", [])]
        for family in ("iptables", "ip6tables"):
            binary = _binary(family)
            if binary is None:
                continue
            for i in range(0, len(ports), 15):
                _run([*sudo, binary, "-D", "INPUT", "-p", "tcp", "-m", "multiport", "--dports",
                      ",".join(map(str, ports[i:i + 15])), "-j", chain])
            _run([*sudo, binary, "-F", chain])
            _run([*sudo, binary, "-X", chain])
    os.unlink(path)
    return FenceReply(tool=None)
