"""The key a detached run's coordinator reaches the other hosts with (`dtf train --detach`),
and the SSH connections it keeps with it (`end_connections`, on the coordinator's host), as this
host lets it in: a line of ~/.ssh/authorized_keys that dtf adds (`authorize`, in
dtf_server.detached), keeps within the lease (`refresh`) and removes (`deauthorize`: `clean`, and
the lease's end).

The line lets in as little as OpenSSH allows: `restrict` (no port, agent or X11 forwarding, no
pty, no ~/.ssh/rc), `from=` the coordinator's addresses only, and `expiry-time=` the lease's end
(refreshed while the lease is renewed), so that a cluster nobody renews stops letting it in even
where nothing runs to remove it (a spare). It is marked with a token of its own: the user's other
lines are never touched, and the file is replaced whole (a rename), never left half-written.
~/.ssh is locked (flock on the directory) while it changes: two clusters on one host take turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import signal
import socket
import time
from collections.abc import Iterator

from dtf_server.procs import read_json, write_json
from dtf_server.protocol import Layout, Lease

MARK = "dtf-coordinator"  # the key line's comment: MARK:TOKEN
EXPIRY_MARGIN = 600.0  # seconds the key outlives the lease (expiry-time counts in minutes)
KEY = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa) [A-Za-z0-9+/]+={0,2}$")
NAME = re.compile(r"^[A-Za-z0-9._:-]+$")


def authorized_keys() -> str:
    return os.path.expanduser("~/.ssh/authorized_keys")


@contextlib.contextmanager
def ssh_dir_locked() -> Iterator[str]:
    """~/.ssh, made (0700) where it is missing, locked while the block runs."""
    directory = os.path.dirname(authorized_keys())
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield directory
    finally:
        os.close(fd)


def expiry_time(when: float) -> str:
    """sshd's expiry-time: YYYYMMDDHHMM in the host's local time (OpenSSH 7.7 and later)."""
    return time.strftime("%Y%m%d%H%M", time.localtime(when))


def key_line(key: str, allow: list[str], expires: float | None, token: str) -> str:
    options = ["restrict"]
    if allow:
        options.append(f'from="{",".join(allow)}"')
    if expires is not None:
        options.append(f'expiry-time="{expiry_time(expires)}"')
    return f"{','.join(options)} {key} {MARK}:{token}"


def rewrite(path: str, drop: str, add: str | None) -> bool:
    """authorized_keys without the lines marked `drop` (MARK:TOKEN), with `add` at its end: a new
    file renamed over the old (its mode kept), so sshd never reads it half-written; a link's target
    is the file replaced, the link stays. Whether the file is left empty."""
    path = os.path.realpath(path)
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        lines, mode = [], 0o600
    kept = [line for line in lines if not line.rstrip().endswith(f" {drop}")]
    if add is not None:
        kept.append(add)
    tmp = f"{path}.dtf-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return not kept


def allowed(names: list[str]) -> list[str]:
    """The coordinator's addresses as sshd's from= matches them: each as given, and the IP
    addresses a name resolves to here (sshd compares names only where UseDNS is on); loopback
    too where they are loopback (a client's source address on lo may be 127.0.0.1)."""
    found: list[str] = []
    for name in names:
        found.append(name)
        try:
            ipaddress.ip_address(name)
        except ValueError:
            with contextlib.suppress(OSError):
                found += [str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)]
    for address in list(found):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(address).is_loopback:
                found += ["127.0.0.1", "::1"]
    return list(dict.fromkeys(found))


def read_lease(root: str) -> Lease | None:
    data = read_json(os.path.join(root, Layout.LEASE))
    try:
        return None if data is None else Lease(ttl=float(data["ttl"]), renewed=float(data["renewed"]))
    except (KeyError, TypeError, ValueError):
        return None


def expires(lease: Lease | None, ttl: float = 0.0) -> float | None:
    """When the key stops letting the coordinator in: the lease's end and a margin (None: a lease
    that never lapses, ttl 0). A host with no lease yet (a spare) counts `ttl` from now: the
    coordinator renews its lease from then on."""
    if lease is None:
        return time.time() + ttl + EXPIRY_MARGIN if ttl else None
    if not lease.ttl:
        return None
    return max(lease.renewed, time.time()) + lease.ttl + EXPIRY_MARGIN


def refresh(root: str, lease: Lease) -> None:
    """The lease was renewed: keep the key's expiry-time ahead of it (rewritten only once half of
    the time left is gone, so a renewal a minute does not rewrite the file a minute)."""
    record = read_json(os.path.join(root, Layout.AUTHORIZED))
    if not record:
        return
    until = expires(lease)
    old = record.get("expires")
    if old is not None and until is not None and old - time.time() > (until - time.time()) / 2:
        return
    with contextlib.suppress(OSError), ssh_dir_locked():
        line = key_line(record["key"], record["allow"], until, record["token"])
        rewrite(record["file"], f"{MARK}:{record['token']}", line)
        write_json(os.path.join(root, Layout.AUTHORIZED), {**record, "expires": until})


def deauthorize(root: str) -> str | None:
    """Remove the key `authorize` added for this cluster (`clean`, the lease's end): None, or why
    it could not be removed."""
    path = os.path.join(root, Layout.AUTHORIZED)
    record = read_json(path)
    if not record:
        return None
    try:
        with ssh_dir_locked():
            empty = rewrite(record["file"], f"{MARK}:{record['token']}", None)
            if empty and record.get("created"):
                os.unlink(record["file"])
    except OSError as e:
        return f"{record['file']}: {e.strerror or e}"
    with contextlib.suppress(OSError):
        os.unlink(path)
    return None


def end_connections(root: str) -> int:
    """TERM the SSH clients a detached run's coordinator started from this host (its masters fork
    into sessions of their own, so its process group's end leaves them): every process of this
    user that reads the run's ssh_config (`-F ROOT/detached/ssh/config`). How many there were."""
    configs = {os.fsencode(os.path.join(where, Layout.DETACHED, "ssh", "config"))
               for where in (os.path.abspath(root), os.path.realpath(root))}
    found = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.getuid():
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"-F" in argv and configs & set(argv):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(name), signal.SIGTERM)
                found += 1
    return found
