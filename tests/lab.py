"""An SSH lab on one machine: N "hosts", each a real sshd, for dtf's end-to-end tests.

Mode "netns": a bridge dtflab0 (10.213.37.1/24) in the root namespace and, per host i, a network
namespace dtflab-h{i} whose eth0 (10.213.37.{11+i}) is a veth on that bridge, running its own
sshd. Mode "loopback" (when namespaces cannot be made): the sshds run in the root namespace on
127.0.0.{11+i}. Traffic only ever goes to the lab's own subnet or loopback; the subnet is checked
to be routed on-link to dtflab0 before anything is started.

Disks: the hosts share this machine's filesystem, except PRIVATE (/srv): each sshd runs in a mount
namespace of its own with a tmpfs there, so what a host writes below /srv only that host sees,
and what the laptop keeps below /srv no host sees. `lab.laptop_dir()` is such a place on the
laptop (a program run from there, with relative output paths, is a program whose files the hosts
cannot see); `lab.exists(host, path)` looks at a path as that host sees it.

Users: every host is reached as root (ssh_config's `User root`), whose home there is the host's own
(in its PRIVATE: what a host writes to ~, its ~/.ssh/authorized_keys, is never this machine's), and
also has non-root login users
of its own (USERS): SUDO_USER may run the firewall tools (nft, iptables, ip6tables) with sudo and no
password, PASSWORD_SUDO_USER only with a password. Their accounts and sudo rules exist only in
each host's mount namespace: modified copies of /etc/passwd, /etc/group, /etc/shadow and
/etc/sudoers (kept below the lab's root) are the top layers of a read-only overlay over its /etc,
whose bottom layer is the machine's /etc; the machine's files are never written. (Not each file
bound over the machine's: the machine replaces /etc/passwd by a rename whenever an account is
added, by useradd or a package's install script, and the kernel then drops a mount on the replaced
file in every namespace: the users vanished from every live lab's hosts, and their logins were
refused for the rest of the run.)
Their homes are in the host's PRIVATE; `lab.as_user(host, user)` is an inventory entry's keys
that reach the host as that user (`user:`, a workdir in that home, a python the user can run:
for fake servers only, see `_write_python`).

Two labs side by side (two checkouts testing at once) need their own name and subnet. Without
DTF_LAB_NAME / DTF_LAB_SUBNET in the environment (see lab_identity()), a lab takes the first free
pair of IDENTITIES (dtflab 10.213.37, then dtflabxa 10.213.200, dtflabxb 10.213.201, ...): its
name's lock not held by another lab, its subnet not routed here. With them, it takes that pair or fails. In loopback mode the
hosts' addresses are 127.0.X.11... with X the subnet's third number.

    with Lab(n_hosts=3, root=tmp) as lab:
        lab.run(lab.hosts[0], ["ip", "-br", "addr"], timeout=5)
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

PREFIX = "dtflab"  # every lab name starts with it: namespaces <name>-h<i>, veths <name>-v<i>, bridge <name>0
NAME_RE = re.compile(rf"^({PREFIX}[a-z]*)(?:-[hv]\d+|0)$")
LOOPBACK_UNUSED = "127.0.0.250"
SSHD = "/usr/sbin/sshd"
MARKER = f"# {PREFIX} sshd, owner pid "  # first line of every lab sshd_config
PORT_RANGE = (21000, 29000)
PRIVATE = "/srv"  # each host's own tmpfs (a mount namespace per sshd); the laptop's own /srv otherwise
SUDO_USER = "dtfsudo"  # a non-root login user with passwordless sudo for the firewall tools
PASSWORD_SUDO_USER = "dtfsudopw"  # a non-root login user whose sudo for them asks for a password
USERS = (SUDO_USER, PASSWORD_SUDO_USER)
FIREWALL_TOOLS = ("nft", "iptables", "ip6tables")
FIRST_UID = 2000  # the users' uids (and their groups' gids): the first free from here


# The (name, subnet) pairs a lab picks from when none is given: the first one free. After the
# default, names and subnets of their own (dtflabx*, 10.213.200+), away from the short names and
# low subnets people set by hand (DTF_LAB_NAME=dtflabp DTF_LAB_SUBNET=10.213.41): a lab that
# picked one of those would make the person's next run fail on it.
IDENTITIES = [(PREFIX, "10.213.37"), *((f"{PREFIX}x{c}", f"10.213.{200 + i}") for i, c in enumerate("abcdefghijklmnop"))]


def lab_identity() -> dict[str, str] | None:
    """The lab's name and subnet from DTF_LAB_NAME / DTF_LAB_SUBNET (either may be left out: the
    other of its IDENTITIES pair, or the default's); None when neither is set: pick a free pair."""
    name, subnet = os.environ.get("DTF_LAB_NAME"), os.environ.get("DTF_LAB_SUBNET")
    if not name and not subnet:
        return None
    paired = dict(IDENTITIES)
    return {"name": name or next((n for n, s in IDENTITIES if s == subnet), PREFIX),
            "subnet": subnet or paired.get(name or "", IDENTITIES[0][1])}


def second_identity() -> dict[str, str] | None:
    """A second lab's name and subnet (a test that builds a larger lab beside the session's),
    from DTF_LAB2_NAME / DTF_LAB2_SUBNET; None when unset: pick a free pair (`Lab(pick=True)`)."""
    name, subnet = os.environ.get("DTF_LAB2_NAME"), os.environ.get("DTF_LAB2_SUBNET")
    return {"name": name, "subnet": subnet} if name and subnet else None


def _routed(subnet: str) -> str:
    """How `subnet`.0/24 is routed here ("" if it is not)."""
    return _sh(["ip", "-4", "route", "show", "root", f"{subnet}.0/24"], check=False).stdout.strip()


def lab_mode(ci: bool) -> str:
    """The mode the tests ask for. Under CI only network namespaces will do: the loopback
    fallback would skip the partition, ProxyJump and unreachable-host tests, and CI must run them."""
    return "netns" if ci else "auto"


class LabError(RuntimeError):
    """The lab could not be built or used."""


class LabUnsupported(LabError):
    """The operation needs network namespaces, and this lab runs in loopback mode."""


@dataclass
class Host:
    name: str  # "h0": the ssh_config alias
    address: str
    port: int  # sshd port (22 unless loopback mode found 22 taken)
    netns: str | None  # None in loopback mode
    workdir: str  # this host's own dtf workdir (on the filesystem the hosts share; PRIVATE is not)
    proc: subprocess.Popen[bytes] | None = None


def _sh(argv: Sequence[str], timeout: float = 10.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _processes(needles: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    """Per key, the live processes (other than this one) whose command line holds its needle as a
    whole path (not followed by more of a name: /srv/dtf-dtflab is not in /srv/dtf-dtflabxb/...)."""
    wholes = {key: re.compile(re.escape(needle.rstrip("/")) + r"(?![\w.-])") for key, needle in needles.items()}
    out: dict[str, list[tuple[int, str]]] = {key: [] for key in needles}
    for pid in _pids():
        cmd = _cmdline(pid)
        if pid == os.getpid() or not cmd:
            continue
        for key, whole in wholes.items():
            if whole.search(cmd) and _alive(pid):
                out[key].append((pid, cmd))
    return out


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _tree(root_pid: int) -> list[int]:
    """root_pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kill(pids: Sequence[int], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive at the deadline."""
    mine = {os.getpid(), os.getppid()}
    pids = [p for p in pids if p not in mine]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def _kill_trees(roots: Sequence[int]) -> None:
    """Kill the roots' descendants first, so a live parent reaps them (no zombies), then the roots."""
    trees = [_tree(r) for r in roots]
    children = [p for t in trees for p in t[1:]]
    _kill(children)
    deadline = time.monotonic() + 2
    while any(Path(f"/proc/{p}").exists() for p in children) and time.monotonic() < deadline:
        time.sleep(0.02)  # until the parents have reaped them
    _kill([t[0] for t in trees])


def blocked(drop: bool) -> str:
    """The nftables verdict for the laptop's blocked connections: reset (an answer at once), or
    dropped (no answer at all, as many sites' firewalls do)."""
    return "drop" if drop else "reject with tcp reset"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _bindable(addr: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
            return True
        except OSError:
            return False


def _ports_in_use(pid: int) -> set[int]:
    """Local TCP ports bound in the network namespace of `pid` (via /proc/<pid>/net/tcp*)."""
    used: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        used.update(int(line.split()[1].rsplit(":", 1)[1], 16) for line in lines)
    return used


class Lab:
    def __init__(self, n_hosts: int = 3, root: str | Path = "/tmp/dtflab", mode: str = "auto",
                 name: str | None = None, subnet: str | None = None, pick: bool = False,
                 bastion: bool = False) -> None:
        """bastion: the last host is a jump host with OpenSSH's default limits (MaxStartups
        10:30:100, MaxSessions 10), and ssh_config reaches every other host through it (ProxyJump).
        mode: "auto" (netns, else loopback), "netns" or "loopback". name/subnet: this pair
        (name must match dtflab[a-z]*, subnet a /24 prefix); default lab_identity(), and where
        that is None, or with `pick` (a second lab beside the session's), the first free pair of
        IDENTITIES, chosen when the lab is built (self.name and self.subnet then say which)."""
        fixed = None if pick else ({"name": name, "subnet": subnet} if name and subnet else lab_identity())
        self.pick = fixed is None
        name, subnet = (fixed["name"], fixed["subnet"]) if fixed else IDENTITIES[0]
        assert mode in ("auto", "netns", "loopback") and NAME_RE.match(f"{name}0") and n_hosts <= 200
        self.name, self.subnet, self.bridge = name, subnet, f"{name}0"
        self.n_hosts = n_hosts
        self.bastion_name = f"h{n_hosts - 1}" if bastion else None
        self.root = Path(root).resolve()
        self.requested_mode = mode
        self.mode = ""  # "netns" or "loopback" once entered
        self.hosts: list[Host] = []
        self.ssh_config = self.root / "ssh_config"
        self.key = self.root / "id_lab"
        self.wrong_key = self.root / "id_wrong"
        self.known_hosts = self.root / "known_hosts"
        self.unused_address = ""
        self.unused_port = 22
        self._next_port = PORT_RANGE[0]
        self._lock: IO[str] | None = None  # flock on /run/<name>.lock: we own the namespace names
        self._laptop_dirs: list[Path] = []
        self.uids: dict[str, int] = {}  # USERS' uids (each user's group has the same number)

    # ---- building -------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        os.makedirs(PRIVATE, exist_ok=True)  # the mount point of each host's own tmpfs
        for key in (self.key, self.wrong_key):
            key.unlink(missing_ok=True)
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name, "-f", str(key)])
        self.mode = "loopback" if self.requested_mode == "loopback" else self._try_netns()
        loopback = f"127.0.{self.subnet.rsplit('.', 1)[1]}"  # another lab's subnet, other addresses
        if self.mode == "loopback":
            self.unused_address = f"{loopback}.{LOOPBACK_UNUSED.rsplit('.', 1)[1]}"
            self.unused_port = self.ports(1)[0]
        for i in range(self.n_hosts):
            if self.mode == "netns":
                addr, port, ns = f"{self.subnet}.{11 + i}", 22, f"{self.name}-h{i}"
            else:
                addr, ns = f"{loopback}.{11 + i}", None
                port = 22 if _bindable(addr, 22) else self.ports(1)[0]
            workdir = self.root / f"h{i}" / "home" / "dtf"
            workdir.mkdir(parents=True, exist_ok=True)
            self.hosts.append(Host(f"h{i}", addr, port, ns, str(workdir)))
        self._write_client_files()
        self._write_accounts()
        self._write_python()
        for h in self.hosts:
            h.proc = self._start_sshd(h)
        deadline = time.monotonic() + 15
        for h in self.hosts:
            self._wait_sshd(h, deadline)

    def _take(self, name: str) -> bool:
        """Hold the lock of lab `name` (then we own its namespace names); False if another lab does."""
        lock = open(f"/run/{name}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()  # and leave self._lock None: close() must not touch the other lab
            return False
        self._lock = lock
        return True

    def _pick_identity(self) -> None:
        """The first pair of IDENTITIES whose lock no other lab holds and whose subnet is not
        routed here (another lab's, set by hand, or anything else's)."""
        for name, subnet in IDENTITIES:
            if not self._take(name):
                continue
            if _routed(subnet) and not _links_of(name):  # routed, and not by a stale lab of that name
                assert self._lock is not None
                self._lock.close()
                self._lock = None
                continue
            self.name, self.subnet, self.bridge = name, subnet, f"{name}0"
            return
        raise LabError(f"no free lab identity: every one of {IDENTITIES[0]}...{IDENTITIES[-1]} is in use")

    def _try_netns(self) -> str:
        if self.pick:
            self._pick_identity()
        elif not self._take(self.name):
            raise LabError(f"another lab named {self.name} is running (/run/{self.name}.lock)")
        Lab._cleanup_netns(self.name)
        sub, bridge = self.subnet, self.bridge
        ns0 = f"{self.name}-h0"
        r = _sh(["ip", "netns", "add", ns0], check=False)
        if r.returncode != 0:
            if self.requested_mode == "netns":
                raise LabError(f"ip netns add failed: {r.stderr.strip()}")
            print(f"lab: network namespaces unavailable ({r.stderr.strip() or r.returncode}); "
                  f"falling back to sshd on 127.0.0.x", file=sys.stderr)
            return "loopback"
        clash = _sh(["ip", "-4", "route", "show", "root", f"{sub}.0/24"]).stdout.strip()
        if clash:
            raise LabError(f"{sub}.0/24 is already routed here ({clash}); refusing to touch it")
        # The subnet is routed on-link to our bridge before anything targets it: a packet to an
        # unused lab address dies in ARP on this machine.
        _sh(["ip", "link", "add", bridge, "type", "bridge"])
        _sh(["ip", "addr", "add", f"{sub}.1/24", "dev", bridge])
        _sh(["ip", "link", "set", bridge, "up"])
        # ARP for an unused lab address gives up after 3 x 200 ms (default 3 x 1 s): EHOSTUNREACH fast.
        Path(f"/proc/sys/net/ipv4/neigh/{bridge}/retrans_time_ms").write_text("200")
        self.unused_address = f"{sub}.250"
        route = _sh(["ip", "-4", "route", "get", self.unused_address]).stdout
        if f"dev {bridge} " not in route or " via " in route:
            raise LabError(f"{sub}.0/24 is not routed on-link to {bridge}: {route.strip()}")
        _room_for_neighbours(self.n_hosts)
        for i in range(self.n_hosts):
            ns, veth = f"{self.name}-h{i}", f"{self.name}-v{i}"
            if i:
                _sh(["ip", "netns", "add", ns])
            _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "link", "set", veth, "master", bridge, "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{sub}.{11 + i}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        return "netns"

    def _write_client_files(self) -> None:
        known, blocks = [], []
        entries = [(h.name, h.address, h.port) for h in self.hosts]
        for name, addr, port in entries:
            hdir = self.root / name
            hostkey = hdir / "ssh_host_ed25519_key"
            hostkey.unlink(missing_ok=True)
            Path(f"{hostkey}.pub").unlink(missing_ok=True)
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(hostkey)])
            pub = Path(f"{hostkey}.pub").read_text().split()
            where = addr if port == 22 else f"[{addr}]:{port}"
            known.append(f"{name},{where} {pub[0]} {pub[1]}")
            (hdir / "sshd_config").write_text(
                f"{MARKER}{os.getpid()}\n"
                f"ListenAddress {addr}:{port}\nHostKey {hostkey}\n"
                f"AuthorizedKeysFile {self.root / 'authorized_keys'} .ssh/authorized_keys\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                f"PidFile {hdir / 'sshd.pid'}\nSubsystem sftp internal-sftp\n"
                + ("" if name == self.bastion_name else "MaxStartups 100\nMaxSessions 100\n")
                + "LogLevel VERBOSE\n"
                + "SetEnv " + " ".join(f"{k}={v}" for k, v in self._session_env(name).items()) + "\n"
            )
        (self.root / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        self.known_hosts.write_text("\n".join(known) + "\n")
        for name, addr, port in entries + [("unreachable", self.unused_address, self.unused_port)]:
            jump = f"  ProxyJump {self.bastion_name}\n" if self.bastion_name not in (None, name) else ""
            if name == self.bastion_name:  # ssh's jump connection gets no -i: the key comes from here
                jump = f"  IdentityFile {self.key}\n"
            blocks.append(f"Host {name}\n  HostName {addr}\n  User root\n  Port {port}\n"
                          f"  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n{jump}")
        self.ssh_config.write_text("\n".join(blocks))

    def _session_env(self, name: str) -> dict[str, str]:
        """The environment sshd sets for every session on host `name` (sshd_config's SetEnv, one
        line: sshd takes the first only). SHLVL=1: the command's shell is not the top level, so
        bash does not source ~/.bashrc, as Debian's does for a command run by sshd. The lab's
        hosts are this machine's root, whose ~/.bashrc may run `pyenv init` (dozens of processes)
        in each SSH command, a large part of `make test`'s CPU. A host's own rc files are not what
        the tests are about; the lab's inventories name every python."""
        return {"SHLVL": "1"}

    def _start_sshd(self, h: Host) -> subprocess.Popen[bytes]:
        """sshd in the host's network namespace and in a mount namespace of its own whose PRIVATE
        is a fresh tmpfs holding USERS' homes, and whose /etc shows the lab's copies of passwd,
        group, shadow and sudoers over the machine's /etc (every process it starts inherits both).
        Each step execs the next: the Popen's pid is sshd's."""
        prefix = ["ip", "netns", "exec", h.netns] if h.netns else []
        sshd = [SSHD, "-D", "-e", "-f", str(self.root / h.name / "sshd_config")]
        q = shlex.quote
        steps = [f"mount -t tmpfs -o mode=0755 dtflab-{h.name} {PRIVATE}"]
        # A read-only overlay (lower layers only, the first on top): no upper layer to write to, and
        # its mount point is the directory /etc, which nothing renames (see the module's doc).
        lower = ":".join([*(str(layer) for layer in self._etc_layers(h)), "/etc"])
        steps += [f"mount -t overlay -o {q('lowerdir=' + lower)} dtflab-{h.name}-etc /etc"]
        python = os.path.dirname(self._python_of(h))
        if (self.root / "python").exists():
            steps += [f"mkdir -p {q(os.path.dirname(python))}", f"cp -R {q(str(self.root / 'python'))} {q(python)}",
                      f"chmod -R a+rX {q(python)}"]
        for user, uid in self.uids.items():  # their homes, where sshd finds their key
            home = self.home(h, user)
            steps += [f"mkdir -p {q(os.path.dirname(home))}",
                      f"install -d -o {uid} -g {uid} -m 0755 {q(home)}",
                      f"install -d -o {uid} -g {uid} -m 0700 {q(home + '/.ssh')}",
                      f"install -o {uid} -g {uid} -m 0600 {q(str(self.root / 'authorized_keys'))} "
                      f"{q(home + '/.ssh/authorized_keys')}"]
        # root's home there too (root logs in with the lab's own authorized_keys, sshd_config's first):
        # what a host writes in its ~ (its ~/.ssh/authorized_keys) is the host's, never this machine's.
        steps += [f"install -d -m 0700 {q(self.home(h, 'root'))}"]
        private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join([*steps, 'exec "$@"']),
                   "sh"]
        log = open(self.root / h.name / "sshd.log", "wb")
        with log:
            return subprocess.Popen(prefix + private + sshd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    # ---- the non-root users (USERS) ----------------------------------------------------------

    def home(self, host: Host | str, user: str) -> str:
        """That user's home on that host: in its PRIVATE (only that host sees it; the lab's root
        may be below a directory only root may enter), named after the lab and the host, so that
        `processes(path)` tells the hosts' and two labs' processes apart."""
        return f"{PRIVATE}/{self.name}-{self.host(host).name}/{user}"

    def as_user(self, host: Host | str, user: str) -> dict[str, str]:
        """An inventory entry's keys that reach that host as `user`: the login, a workdir in the
        user's home, and the users' python there (`_write_python`)."""
        assert user in USERS, user
        if not (self.root / "python").exists():
            raise LabError(f"the lab's users (uid {self.uids[user]}) can run neither {sys.executable} nor /usr/bin/python3")
        return {"user": user, "workdir": f"{self.home(host, user)}/dtf", "python": self._python_of(self.host(host))}

    def _python_of(self, h: Host) -> str:
        return f"{PRIVATE}/{self.name}-{h.name}/python/python"

    def _write_python(self) -> None:
        """The users' python, copied to each host's PRIVATE at its start: the first python they may
        run (this one may be below root's home, which they cannot enter, with its TensorFlow),
        else the machine's python3; with this machine's TensorFlow's metadata (a dist-info
        directory holding only its name and version) first on its PYTHONPATH. The servers of the
        tests that log in as these users are fake ones: the metadata passes dtf's TensorFlow check
        (the host's TensorFlow is this machine's version), nothing imports TensorFlow."""
        uid = self.uids[SUDO_USER]
        here = self.root / "python"
        shutil.rmtree(here, ignore_errors=True)
        for python in (sys.executable, "/usr/bin/python3"):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                if subprocess.run([python, "-c", ""], user=uid, group=uid, extra_groups=[],
                                  cwd="/", capture_output=True, timeout=30).returncode == 0:
                    break
        else:
            return  # none: `as_user` says so (the rest of the lab does not need it)
        for dist in ("tensorflow", "tensorflow-cpu"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(dist)
                info = here / "tf" / f"{dist.replace('-', '_')}-{version}.dist-info"
                info.mkdir(parents=True)
                (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        here.mkdir(exist_ok=True)
        (here / "python").write_text('#!/bin/sh\nPYTHONPATH="$(dirname "$0")/tf${PYTHONPATH:+:$PYTHONPATH}" '
                                     f'exec {shlex.quote(python)} "$@"\n')
        (here / "python").chmod(0o755)

    def _etc_layers(self, h: Host) -> list[Path]:
        """The directories of the lab's copies `_write_accounts` made, top first, that the host's
        /etc shows over the machine's: its own passwd (its users' homes), then the lab's group,
        shadow and sudoers."""
        layers = [self.root / h.name / "etc", self.root / "etc"]
        if any(c in str(self.root) for c in ":,\\"):  # an overlay's lowerdir separates its layers by them
            raise LabError(f"the lab's root may hold no ':', ',' or '\\': {self.root}")
        return layers

    def _write_accounts(self) -> None:
        """Copies of this machine's /etc/passwd (one per host: the homes differ), group, shadow
        and sudoers (where sudo is installed) with USERS added; the copies keep their originals'
        owner and mode (sudo reads only a sudoers file of root's, mode 0440), and their directories
        (`_etc_layers`) /etc's: an overlay's directory takes its top layer's."""
        etc = Path("/etc")
        lines = {name: [line for line in (etc / name).read_text().splitlines()
                        if line.split(":", 1)[0] not in USERS]
                 for name in ("passwd", "group", "shadow") if (etc / name).exists()}
        taken = {int(f[2]) for name in ("passwd", "group") for line in lines.get(name, [])
                 if len(f := line.split(":")) > 2 and f[2].isdigit()}
        free = (i for i in range(FIRST_UID, 60000) if i not in taken)
        self.uids = {user: next(free) for user in USERS}
        today = int(time.time() // 86400)
        added = {"group": [f"{u}:x:{uid}:" for u, uid in self.uids.items()],
                 "shadow": [f"{u}:*:{today}:0:99999:7:::" for u in self.uids]}
        st = etc.stat()
        for h in self.hosts:
            for layer in self._etc_layers(h):
                layer.mkdir(exist_ok=True)
                os.chown(layer, st.st_uid, st.st_gid)
                layer.chmod(st.st_mode & 0o7777)
        for name, extra in added.items():
            if name in lines:
                self._copy_of(etc / name, self.root / "etc" / name, lines[name] + extra)
        for h in self.hosts:
            self._copy_of(etc / "passwd", self.root / h.name / "etc" / "passwd", [
                self._root_home(line, self.home(h, "root")) for line in lines["passwd"]] + [
                f"{u}:x:{uid}:{uid}:dtf lab user:{self.home(h, u)}:/bin/bash" for u, uid in self.uids.items()])
        if not (etc / "sudoers").exists():
            return  # no sudo here: the users have none
        tools = ", ".join(p for t in FIREWALL_TOOLS if (p := shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin")))
        sudoers = self.root / "etc" / "sudoers"
        self._copy_of(etc / "sudoers", sudoers, (etc / "sudoers").read_text().splitlines() + [
            "# the dtf lab's users (tests/lab.py)",
            f"{SUDO_USER} ALL=(root) NOPASSWD: {tools}",
            f"{PASSWORD_SUDO_USER} ALL=(root) {tools}"])
        if shutil.which("visudo", path="/usr/sbin:/usr/bin:/sbin:/bin"):
            r = _sh(["visudo", "-c", "-q", "-f", str(sudoers)], check=False)
            if r.returncode != 0:
                raise LabError(f"the lab's sudoers ({sudoers}) does not parse: {(r.stdout + r.stderr).strip()}")

    @staticmethod
    def _root_home(line: str, home: str) -> str:
        """A passwd line, root's with `home` for its home (the host's own, in its PRIVATE)."""
        fields = line.split(":")
        if len(fields) == 7 and fields[0] == "root":
            fields[5] = home
        return ":".join(fields)

    @staticmethod
    def _copy_of(original: Path, copy: Path, lines: list[str]) -> None:
        copy.unlink(missing_ok=True)
        with open(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:  # (shadow's hashes)
            f.write("\n".join(lines) + "\n")
        st = original.stat()
        os.chown(copy, st.st_uid, st.st_gid)
        copy.chmod(st.st_mode & 0o7777)

    def _wait_sshd(self, h: Host, deadline: float) -> None:
        while True:
            assert h.proc is not None
            if h.proc.poll() is not None:
                break
            try:
                with socket.create_connection((h.address, h.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        log = (self.root / h.name / "sshd.log").read_text(errors="replace")[-2000:]
        raise LabError(f"sshd for {h.name} at {h.address}:{h.port} not ready (exit {h.proc.poll()}):\n{log}")

    # ---- using ----------------------------------------------------------------------------

    def host(self, host: Host | str) -> Host:
        if isinstance(host, Host):
            return host
        for h in self.hosts:
            if host in (h.name, h.address, h.workdir):
                return h
        raise KeyError(host)

    def run(self, host: Host | str, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run argv on this machine as the host's processes run: in its network namespace and
        with its disks (its own PRIVATE)."""
        h = self.host(host)
        assert h.proc is not None
        prefix = ["nsenter", "--target", str(h.proc.pid), "--mount", *(["--net"] if h.netns else [])]
        return subprocess.run(prefix + list(argv), capture_output=True, text=True, timeout=timeout)

    def exists(self, host: Host | str, path: str | Path) -> bool:
        """Whether `path` exists as that host sees its disks."""
        return self.run(host, ["test", "-e", str(path)], timeout=10).returncode == 0

    def laptop_dir(self, name: str) -> Path:
        """A fresh directory on the laptop below PRIVATE: no lab host sees it (removed at close)."""
        path = Path(PRIVATE) / f"{self.name}-laptop-{os.getpid()}" / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        self._laptop_dirs.append(path.parent)
        return path

    def _link(self, host: Host | str, state: str) -> None:
        h = self.host(host)
        if h.netns is None:
            raise LabUnsupported(f"link_{state} needs network namespaces (lab mode {self.mode})")
        _sh(["ip", "-n", h.netns, "link", "set", "eth0", state])

    def nft(self, host: Host | str | None, script: str) -> None:
        """Load an nftables script in a lab host's namespace (None: this machine's, the laptop's)."""
        prefix = [] if host is None else ["ip", "netns", "exec", str(self.host(host).netns)]
        r = subprocess.run([*prefix, "nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise LabError(f"nft failed: {r.stderr.strip()}")

    def connects(self, host: Host | str | None, address: str, port: int) -> bool:
        """Whether a TCP connection from that lab host (None: this machine) to address:port opens."""
        if host is None:
            try:
                with socket.create_connection((address, port), timeout=3):
                    return True
            except OSError:
                return False
        code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=3)"
        return self.run(host, [sys.executable, "-c", code], timeout=20).returncode == 0

    def tables(self, host: Host | str) -> list[str]:
        """The nftables tables of a lab host (`inet NAME`...)."""
        r = self.run(host, ["nft", "list", "tables"], timeout=10)
        return [line.removeprefix("table ").strip() for line in r.stdout.splitlines() if line.strip()]

    @contextlib.contextmanager
    def laptop_blocked(self, drop: bool = False) -> Iterator[None]:
        """This machine (the laptop) reaches the lab's hosts on port 22 only, as from behind a
        NAT to a cloud that opens only SSH: a rule in this machine's own namespace, for the lab's
        subnet only, removed on exit. The other ports' connections are reset, or (`drop`) their
        packets dropped: no answer at all, as many sites' firewalls do."""
        if self.mode != "netns":
            raise LabUnsupported(f"blocking the laptop needs network namespaces (lab mode {self.mode})")
        table = f"{self.name}_laptop"
        self.nft(None, f"table inet {table} {{\n chain out {{\n  type filter hook output priority 0;\n"
                       f"  ip daddr {self.subnet}.0/24 tcp dport != 22 {blocked(drop)}\n }}\n}}\n")
        try:
            yield
        finally:
            _sh(["nft", "delete", "table", "inet", table], check=False)

    @contextlib.contextmanager
    def laptop_cut(self) -> Iterator[None]:
        """This machine (the laptop) cut off from the lab's hosts, as a dropped Wi-Fi does: every
        packet between it and the lab's subnet dropped, both ways, SSH's included; the hosts still
        reach each other (their traffic crosses the bridge, never this machine's own input and
        output). A rule in this machine's own namespace, removed on exit."""
        if self.mode != "netns":
            raise LabUnsupported(f"cutting the laptop off needs network namespaces (lab mode {self.mode})")
        table = f"{self.name}_cut"
        self.nft(None, f"table inet {table} {{\n"
                       f" chain out {{\n  type filter hook output priority 0;\n  ip daddr {self.subnet}.0/24 drop\n }}\n"
                       f" chain in {{\n  type filter hook input priority 0;\n  ip saddr {self.subnet}.0/24 drop\n }}\n}}\n")
        try:
            yield
        finally:
            _sh(["nft", "delete", "table", "inet", table], check=False)

    def laptop_bytes(self) -> int:
        """Bytes this machine (the laptop) has sent into the lab so far: the TX counter of the
        lab's bridge, the laptop's own port on it. Traffic from host to host is forwarded by the
        bridge between the hosts' veths, never through that port: it is not counted."""
        if self.mode != "netns":
            raise LabUnsupported(f"counting the laptop's bytes needs network namespaces (lab mode {self.mode})")
        return int(Path(f"/sys/class/net/{self.bridge}/statistics/tx_bytes").read_text())

    def link_down(self, host: Host | str) -> None:
        self._link(host, "down")

    def link_up(self, host: Host | str) -> None:
        self._link(host, "up")

    def ports(self, n: int) -> list[int]:
        """n distinct TCP ports, free in the root namespace and on every lab host, never reused."""
        used: set[int] = set()
        for h in self.hosts:
            if h.netns and h.proc is not None and h.proc.poll() is None:
                used |= _ports_in_use(h.proc.pid)
        addrs = ["0.0.0.0", "127.0.0.1"] + ([h.address for h in self.hosts] if self.mode == "loopback" else [])
        out: list[int] = []
        while len(out) < n:
            port = self._next_port
            if port >= PORT_RANGE[1]:
                raise LabError(f"lab ports exhausted ({PORT_RANGE})")
            self._next_port += 1
            if port not in used and all(_bindable(a, port) for a in addrs):
                out.append(port)
        return out

    def inventory(self, path: str | Path, hosts: Sequence[dict[str, Any]], cluster: str = "lab",
                  **defaults: Any) -> Path:
        entries = []
        for entry in hosts:
            entry = dict(entry)
            if "workdir" not in entry and any(h.name == entry.get("host") for h in self.hosts):
                entry["workdir"] = self.host(entry["host"]).workdir
            entries.append(entry)
        doc = {"cluster": cluster, "ssh_config": str(self.ssh_config),
               "defaults": {"identity_file": str(self.key), "python": sys.executable, **defaults},
               "hosts": entries}
        path = Path(path)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def processes_of_hosts(self) -> dict[str, list[tuple[int, str]]]:
        """`processes` of every host, from one pass over /proc."""
        return _processes({h.name: h.workdir for h in self.hosts})

    def processes(self, host_or_workdir: Host | str) -> list[tuple[int, str]]:
        """Live processes whose command line mentions that host's workdir (or the given path), as a
        whole path: /srv/dtf-dtflab is not found in /srv/dtf-dtflabxb/... (a lab named dtflab beside
        one named dtflabxb counted the other's processes as its own in two runs at once)."""
        try:
            needle = self.host(host_or_workdir).workdir
        except KeyError:
            needle = str(host_or_workdir)
        return _processes({needle: needle})[needle]

    def sshd_nodelay(self, host: Host | str) -> list[bool]:
        """TCP_NODELAY of each SSH connection that host's sshd serves now, read from sshd's own
        sockets (pidfd_getfd: Linux 5.6 and root, which the lab has)."""
        import ctypes

        h = self.host(host)
        assert h.proc is not None
        syscall = ctypes.CDLL(None, use_errno=True).syscall
        found = []
        for pid in _tree(h.proc.pid)[1:]:  # the listener's children: one per connection
            try:
                pidfd = os.pidfd_open(pid)
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                with contextlib.suppress(OSError):
                    if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                        continue
                mine = syscall(438, pidfd, int(fd), 0)  # pidfd_getfd: a copy of sshd's descriptor
                if mine < 0:
                    continue
                with socket.socket(fileno=mine) as sock, contextlib.suppress(OSError):
                    if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6) \
                            and sock.getsockname()[1] == h.port:
                        sock.getpeername()  # connected: not the listener
                        found.append(bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
            os.close(pidfd)
        return found

    # ---- tearing down ---------------------------------------------------------------------

    def close(self) -> None:
        """Kill the sshds and everything they started, remove namespaces and bridge. Idempotent."""
        try:
            for h in self.hosts:
                if h.proc is not None:
                    _kill_trees([h.proc.pid])
                    try:
                        h.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
            _kill([pid for pid, _ in self.processes(str(self.root))])
            if self._lock is not None:  # we own the namespace names (also after a half-built netns lab)
                Lab._cleanup_netns(self.name)
            for path in self._laptop_dirs:
                shutil.rmtree(path, ignore_errors=True)
            for etc in [self.root / "etc", *(self.root / h.name / "etc" for h in self.hosts)]:
                shutil.rmtree(etc, ignore_errors=True)  # (a copy of shadow among them)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    @staticmethod
    def _cleanup_netns(name: str) -> None:
        """Kill every process in <name>-h* namespaces, delete them, their veths and the bridge."""
        for ns in _sh(["ip", "netns", "list"], check=False).stdout.split():
            if ns.startswith(f"{name}-h") and NAME_RE.match(ns):
                pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
                _kill_trees([int(p) for p in pids])
                _sh(["ip", "netns", "delete", ns], check=False)
        for link in _links():
            m = NAME_RE.match(link)
            if m and m.group(1) == name:
                _sh(["ip", "link", "delete", link], check=False)
        if shutil.which("nft"):
            _sh(["nft", "delete", "table", "inet", f"{name}_laptop"], check=False)  # laptop_blocked's

    @staticmethod
    def cleanup_stale() -> None:
        """Remove what crashed earlier labs left: namespaces, veths, bridges, orphaned sshds."""
        for pid in _pids():
            cmd = _cmdline(pid) or ""
            if SSHD not in cmd or " -f " not in cmd:
                continue
            try:
                first = Path(cmd.split(" -f ", 1)[1].split()[0]).read_text().splitlines()[0]
            except (OSError, IndexError):
                continue
            if first.startswith(MARKER) and not _alive(int(first[len(MARKER):])):
                _kill_trees([pid])
        names = {m.group(1) for x in _links() + _sh(["ip", "netns", "list"], check=False).stdout.split()
                 if (m := NAME_RE.match(x))}
        for name in sorted(names):
            try:
                with open(f"/run/{name}.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    Lab._cleanup_netns(name)
            except BlockingIOError:
                pass  # a live lab holds the lock: its namespaces are not stale


NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


def _room_for_neighbours(n_hosts: int) -> None:
    """Every namespace shares the kernel's one ARP table (gc_thresh3 entries, default 1024), and
    `up`'s mesh check has each host resolve every other: 100 hosts need 9,900 entries, and past
    the limit the kernel drops them ("neighbor table overflow": No route to host, timeouts).
    Raise the limits (never lower them: other labs may need them) to room for this lab and more."""
    need = {1: 1024, 2: 8 * 1024, 3: 16 * 1024} if n_hosts > 10 else {}
    for level, value in need.items():
        path = Path(NEIGH.format(level))
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text()) < value:
                path.write_text(str(value))


def _links_of(name: str) -> list[str]:
    """The links of lab `name` (its bridge and veths) that exist here."""
    return [link for link in _links() if (m := NAME_RE.match(link)) and m.group(1) == name]


def _links() -> list[str]:
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    return [line.split(":")[1].strip().split("@")[0] for line in out if line.count(":") >= 2]
