"""known_hosts, read and written as OpenSSH does (sshd's hostfile.c, match.c; sshd(8) "SSH_KNOWN_HOSTS
FILE FORMAT"), for the paramiko connections dtf opens.

Reading: every line OpenSSH could use is used; every other line is skipped, as OpenSSH skips it:
comments, `@cert-authority` lines (dtf checks plain host keys, not host certificates), key types
this machine's paramiko does not know, bad base64, short lines. Host fields are comma lists of
patterns with `*` and `?`, negated with `!` (a matching negation excludes the line), `[host]:port`
for a port other than 22, or hashed names (`|1|salt|hmac-sha1`). A key marked `@revoked` is never
accepted.

Writing: dtf never rewrites a known_hosts file (paramiko's own policy would, losing comments,
markers and key types it does not know). A new host's key is appended as one line, under a lock,
to the first UserKnownHostsFile, hashed when HashKnownHosts is yes.

Why not paramiko's own `HostKeys`: it refuses a whole file that holds an `@revoked` or
`@cert-authority` line (InvalidHostKey: paramiko#771), so a revoked key would never be refused;
it matches no pattern with `*`, `?` or `!` (paramiko#1001); `SSHClient` reads neither
UserKnownHostsFile nor GlobalKnownHostsFile; and its `save` rewrites the file. Nor `ssh-keygen
-F`, which reads all of that as OpenSSH does: it comes with the ssh client, and this module serves
where there is none.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import fnmatch
import hashlib
import hmac
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import paramiko

GLOBAL_FILES = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
USER_FILES = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
_append_lock = threading.Lock()  # one dtf process appends from a thread per host


@dataclass(frozen=True)
class Entry:
    """One usable line of a known_hosts file."""

    file: str
    line: int
    hosts: str  # the line's host field: patterns, or a hashed name
    key: paramiko.PKey
    revoked: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def matches(self, name: str) -> bool:
        """Whether this line is about `name` ("host", or "[host]:port" when the port is not 22)."""
        if self.hosts.startswith("|1|"):
            return _hashed_matches(self.hosts, name)
        found = False
        for pattern in self.hosts.split(","):
            negated = pattern.startswith("!")
            if fnmatch.fnmatchcase(name.lower(), pattern.lstrip("!").lower()):
                if negated:
                    return False  # match.c: a negated match excludes the host from the line
                found = True
        return found


def _hashed_matches(field: str, name: str) -> bool:
    try:
        _, _, salt, digest = field.split("|", 3)
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(mac, base64.b64decode(digest))
    except (ValueError, binascii.Error):
        return False


def parse(path: str) -> list[Entry]:
    """The usable lines of one known_hosts file (none if it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        revoked = False
        if fields[0].startswith("@"):
            if fields[0] != "@revoked":
                continue  # @cert-authority, or a marker OpenSSH does not know either
            revoked, fields = True, fields[1:]
        if len(fields) < 3:
            continue
        hosts, keytype, blob = fields[:3]
        try:
            key = paramiko.PKey.from_type_string(keytype, base64.b64decode(blob, validate=True))
        except Exception:  # an unknown key type, bad base64, a malformed key: OpenSSH skips it too
            continue
        entries.append(Entry(path, number, hosts, key, revoked))
    return entries


def host_name(host: str, port: int) -> str:
    """How known_hosts names a host: "[host]:port" for a port other than 22."""
    return host if port == 22 else f"[{host}]:{port}"


def line_for(name: str, key: paramiko.PKey, hashed: bool) -> str:
    field = paramiko.HostKeys.hash_host(name) if hashed else name
    return f"{field} {key.get_name()} {key.get_base64()}\n"


def append(path: str, name: str, key: paramiko.PKey, hashed: bool = False) -> None:
    """Add one line for `name` to the end of `path`, leaving every byte before it as it was."""
    path = os.path.expanduser(path)
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    line = line_for(name, key, hashed)
    with _append_lock:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # another dtf, or an ssh, may append at the same time
            try:
                if any(e.key == key and e.matches(name) for e in parse(path)):
                    return  # added meanwhile (two hosts behind one jump host, another dtf)
                size = f.seek(0, os.SEEK_END)
                if size:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        line = "\n" + line  # a last line without its newline stays whole
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class RevokedHostKey(paramiko.SSHException):
    def __init__(self, name: str, entry: Entry) -> None:
        super().__init__(f"the host key of {name} is marked @revoked in {entry.where}: refusing to connect")
        self.entry = entry


class HostKeyChanged(paramiko.BadHostKeyException):
    pass


class KnownHosts:
    """The known keys of the files one connection's ssh_config names, and what to do with a key
    that is not among them (StrictHostKeyChecking)."""

    def __init__(self, user_files: Sequence[str], global_files: Sequence[str] = GLOBAL_FILES,
                 strict: str = "ask", hashed: bool = False) -> None:
        self.user_files = [os.path.expanduser(f) for f in user_files]
        self.files = [*self.user_files, *(os.path.expanduser(f) for f in global_files)]
        self.strict = strict.lower()
        self.hashed = hashed

    @classmethod
    def from_ssh_config(cls, cfg: Any) -> KnownHosts:
        """From a paramiko SSHConfigDict, or OpenSSH's settings (`ssh -G`, dtf.hosts.openssh: a
        key's values in one string): UserKnownHostsFile, GlobalKnownHostsFile,
        StrictHostKeyChecking, HashKnownHosts."""
        def files(key: str, default: Sequence[str]) -> list[str]:
            value = cfg.get(key)
            if value is None:
                return list(default)
            return value.split() if isinstance(value, str) else list(value)

        return cls(files("userknownhostsfile", USER_FILES), files("globalknownhostsfile", GLOBAL_FILES),
                   strict=str(cfg.get("stricthostkeychecking", "ask")),
                   hashed=str(cfg.get("hashknownhosts", "no")).lower() == "yes")

    def entries(self, name: str) -> list[Entry]:
        return [e for path in self.files for e in parse(path) if e.matches(name)]

    def install(self, client: paramiko.SSHClient, host: str, port: int) -> None:
        """Before `client` connects to host:port: give paramiko the known keys of that host (it
        prefers their key types in the key exchange and refuses a changed key), and a policy
        for a key it does not know."""
        name = host_name(host, port)
        entries = self.entries(name)
        revoked = [e for e in entries if e.revoked]
        known = client.get_host_keys()
        for e in entries:
            if not e.revoked and not any(e.key == r.key for r in revoked):
                known.add(name, e.key.get_name(), e.key)
        client.set_missing_host_key_policy(_Policy(self, revoked, [e for e in entries if not e.revoked]))


class _Policy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko for a key it was not given as known."""

    def __init__(self, known_hosts: KnownHosts, revoked: Iterable[Entry], known: Iterable[Entry]) -> None:
        self.known_hosts, self.revoked, self.known = known_hosts, list(revoked), list(known)

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        for entry in self.revoked:
            if entry.key == key:
                raise RevokedHostKey(hostname, entry)
        if self.known:
            # The host is known by other keys (of other types): OpenSSH calls that a changed key.
            raise HostKeyChanged(hostname, key, self.known[0].key)
        if self.known_hosts.strict not in ("no", "off", "accept-new"):
            raise paramiko.SSHException(f"Server {hostname!r} not found in known_hosts")
        if not self.known_hosts.user_files:
            return
        append(self.known_hosts.user_files[0], hostname, key, self.known_hosts.hashed)
        client.get_host_keys().add(hostname, key.get_name(), key)
