"""A Slurm cluster inside the SSH lab (tests/lab.py): the login host h0 runs sshd and slurmctld,
the compute hosts h1, h2 run slurmd, each in its own network namespace at its own address.

Everything Slurm needs lives below the lab's root, so two labs (or a machine's own Slurm) never
share a file: its own munged (own key, own socket), its own slurm.conf (found through SLURM_CONF,
which the login host's sshd sets for every session: `SetEnv`), state, spool, logs and pid files.
Two traps of running Slurm this way:

- slurmctld checks the machine's hostname against SlurmctldHost: it runs in a UTS namespace of
  its own whose hostname is h0.
- slurmd needs the cgroup mounts under /sys/fs/cgroup, which `ip netns exec` hides (it remounts
  /sys): it is started with `nsenter --net` (no /sys remount) and `unshare -m -u` (its own
  hostname, its own PRIVATE tmpfs, as the lab's sshds have, and the lab's hosts file over
  /etc/hosts: the job steps resolve the nodes' names, as SlurmClusterResolver needs).

Partitions: `main` (default) holds h1 and h2; `stuck` holds only h3, a node that is DOWN (no
slurmd behind it, at the lab's unused address): a job there pends for ever, for "pending" tests.

With `block_laptop` (the default), this machine (the laptop) reaches only the login host's port 22:
the compute hosts' sshd and every other lab port refuse it (nftables in each host's namespace,
for connections from the laptop's address only), as on a site where compute nodes are reached only through Slurm.

`slurmd_timeout` is the lab's SlurmdTimeout: how long slurmctld waits for a node that does not
answer before it marks the node DOWN and ends its jobs (NODE_FAIL). 30 s unless told (the
benchmarks' figures); the tests give 10 s, for the tests that wait for a lost node to be found.

    with SlurmLab(root=tmp) as lab:
        lab.slurm(["sinfo"])                # on the login host, as a user there runs it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from lab import PRIVATE, Host, Lab, LabError, LabUnsupported, _sh, blocked

PACKAGES = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel", "sinfo", "munged")
PARTITION = "main"
STUCK = "stuck"  # a partition whose only node is DOWN: jobs there pend
DOWN_NODE = "h3"


def missing() -> list[str]:
    """The Slurm and MUNGE programs this machine lacks (apt-get install slurmctld slurmd
    slurm-client munge)."""
    return [p for p in PACKAGES if shutil.which(p, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None]


class SlurmLab(Lab):
    def __init__(self, root: str | Path = "/tmp/dtflab-slurm", name: str | None = None,
                 subnet: str | None = None, pick: bool = False, block_laptop: bool = True,
                 slurmd_timeout: int = 30) -> None:
        super().__init__(3, root=root, mode="netns", name=name, subnet=subnet, pick=pick)
        self.slurm_dir = self.root / "slurm"
        self.conf = self.slurm_dir / "slurm.conf"
        self.munge_socket = self.slurm_dir / "munge.socket"
        self.block_laptop = block_laptop
        self.slurmd_timeout = slurmd_timeout
        self._daemons: list[subprocess.Popen[bytes]] = []

    @property
    def login(self) -> Host:
        return self.hosts[0]

    @property
    def computes(self) -> list[Host]:
        return self.hosts[1:]

    def _session_env(self, name: str) -> dict[str, str]:
        # Every SSH session on a lab host finds this lab's Slurm (as /etc/slurm/slurm.conf would).
        return {**super()._session_env(name), "SLURM_CONF": str(self.conf)}

    # ---- building -------------------------------------------------------------------------

    def _build(self) -> None:
        gone = missing()
        if gone:
            raise LabError(f"Slurm lab: missing {', '.join(gone)} (apt-get install slurmctld slurmd slurm-client munge)")
        super()._build()
        if self.mode != "netns":
            raise LabUnsupported("the Slurm lab needs network namespaces")
        shutil.rmtree(self.slurm_dir, ignore_errors=True)
        (self.slurm_dir / "state").mkdir(parents=True)
        self._start_munge()
        self._write_conf()
        self._start_slurmctld()
        for h in self.computes:
            self._start_slurmd(h)
        self._wait_idle(time.monotonic() + 60)
        if self.block_laptop:
            self.close_to_laptop()

    def _daemon(self, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.slurm_dir / log, "ab") as out:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, "SLURM_CONF": str(self.conf)})
        self._daemons.append(proc)
        return proc

    def _start_munge(self) -> None:
        key = self.slurm_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        d = self.slurm_dir
        # --force: munged refuses to run as root otherwise; the lab runs everything as root.
        proc = self._daemon(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                             f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                             f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"], "munged.out")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"munged did not start: {self._tail('munged.out')}{self._tail('munged.log')}")
            time.sleep(0.02)

    def _write_conf(self) -> None:
        d, login = self.slurm_dir, self.login
        nodes = [f"NodeName={h.name} NodeAddr={h.address} CPUs=2 RealMemory=4000 State=UNKNOWN"
                 for h in self.computes]
        nodes.append(f"NodeName={DOWN_NODE} NodeAddr={self.unused_address} CPUs=2 RealMemory=4000 "
                     f"State=DOWN Reason=no_slurmd")
        (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        compute = ",".join(h.name for h in self.computes)
        self.conf.write_text("\n".join([
            f"# the Slurm of lab {self.name} (tests/slurmlab.py)",
            f"ClusterName={self.name}",
            f"SlurmctldHost={login.name}({login.address})",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d}/spool-%n", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SwitchType=switch/none", "MpiDefault=none", "MailProg=/bin/true",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2", f"SlurmdTimeout={self.slurmd_timeout}", "InactiveLimit=0",
            "KillWait=2", "MinJobAge=10", "SchedulerParameters=sched_interval=2",
            *nodes,
            f"PartitionName={PARTITION} Nodes={compute} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName={STUCK} Nodes={DOWN_NODE} MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start_slurmctld(self) -> None:
        h = self.login
        inner = f'hostname {h.name} && exec slurmctld -D -i -f "$0"'
        self._daemon(["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "sh", "-c", inner,
                      str(self.conf)], "slurmctld.out")

    def _start_slurmd(self, h: Host) -> None:
        # Its own mount namespace: a private PRIVATE (as the lab's sshds have) and /sys as this
        # machine's, with the cgroup mounts slurmd reads.
        # The nodes' names resolve there, as at a site (SlurmClusterResolver names the nodes):
        # the lab's own hosts file over /etc/hosts, in slurmd's mount namespace only.
        inner = (f"mount --make-rprivate / && mount -t tmpfs -o mode=0755 dtflab-{h.name} {PRIVATE} && "
                 f"mount --bind {self.slurm_dir / 'hosts'} /etc/hosts && "
                 f'hostname {h.name} && exec slurmd -D -N {h.name} -f "$0"')
        self._daemon(["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--uts", "sh", "-c",
                      inner, str(self.conf)], f"slurmd-{h.name}.out")

    def _wait_idle(self, deadline: float) -> None:
        want = {h.name for h in self.computes}
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead:
                break
            r = self.slurm(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            if r.returncode == 0:
                states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
                if all(states.get(n) == "idle" for n in want):
                    return
            time.sleep(0.2)
        logs = "".join(self._tail(f) for f in ("slurmctld.out", "slurmctld.log", "slurmd-h1.out", "slurmd-h1.log"))
        raise LabError(f"Slurm lab not ready (nodes {states or 'unknown'}):\n{logs}")

    def close_to_laptop(self, drop: bool = False) -> None:
        """The laptop reaches the login host's port 22 only. Its other connections are reset, or
        (`drop`, bench/slurm_up.py --drop) their packets dropped: no answer at all, as from a
        laptop to a site's compute network. Made again from scratch on each call."""
        # In each host's own input hook, by the laptop's source address (the bridge's): a reset
        # made there reaches the laptop at once. (A reject in this machine's own output hook
        # left connections here timing out instead of failing: slow tests.)
        laptop = f"{self.subnet}.1"
        for h in self.hosts:
            allow = "tcp dport != 22 " if h is self.login else "meta l4proto tcp "
            self.nft(h, f"table inet dtf_slurmlab\ndelete table inet dtf_slurmlab\n"
                        f"table inet dtf_slurmlab {{\n chain in {{\n  type filter hook input priority 0;\n"
                        f"  ip saddr {laptop} {allow}{blocked(drop)}\n"
                        f"  ip saddr {laptop} meta l4proto != tcp drop\n }}\n}}\n")

    def _tail(self, name: str) -> str:
        try:
            text = (self.slurm_dir / name).read_text(errors="replace")[-1500:]
        except OSError:
            return ""
        return f"--- {name}:\n{text}\n"

    # ---- using ----------------------------------------------------------------------------

    def slurm(self, argv: Sequence[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm command on the login host (its namespace and disks, this lab's slurm.conf)."""
        return self.run(self.login, ["env", f"SLURM_CONF={self.conf}", *argv], timeout=timeout)

    def queue(self) -> list[str]:
        """The jobs squeue lists (any state it shows), as 'ID STATE'."""
        r = self.slurm(["squeue", "-h", "-o", "%i %T"], timeout=10)
        if r.returncode != 0:
            raise LabError(f"squeue failed: {r.stderr.strip()}")
        return r.stdout.split("\n")[:-1]

    def ssh_argv(self, host: Host | str, *argv: str) -> list[str]:
        """ssh from this machine to a lab host, as a user of the site would."""
        return ["ssh", "-F", str(self.ssh_config), "-i", str(self.key), "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=5", self.host(host).name, *argv]

    def node_path(self, host: Host | str, path: str) -> Path:
        """`path` (absolute) as a compute host's job steps see it: through its slurmd's root
        (/proc/PID/root), in slurmd's mount namespace, where PRIVATE is that node's own disk."""
        h = self.host(host)
        for proc in self._slurmds(h):  # nsenter, unshare and sh each exec the next: the pid is slurmd's
            return Path(f"/proc/{proc.pid}/root") / path.lstrip("/")
        raise LabError(f"no slurmd runs on {h.name}")

    def kill_slurmd(self, host: Host | str) -> None:
        """SIGKILL a compute host's slurmd, as a crashed daemon or a lost node: slurmctld marks the
        node DOWN once it has not answered for SlurmdTimeout (`slurmd_timeout`)."""
        for proc in self._slurmds(self.host(host)):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            self._daemons.remove(proc)

    def _slurmds(self, h: Host) -> list[subprocess.Popen[bytes]]:
        """The compute host's slurmd that runs (a list: the one `_start_slurmd` started, or none)."""
        return [proc for proc in self._daemons
                if proc.poll() is None and f"exec slurmd -D -N {h.name} " in " ".join(map(str, proc.args))]

    def restart_slurmd(self, host: Host | str, timeout: float = 120, idle: bool = True) -> None:
        """Start a killed slurmd again and wait until every compute node is idle (ReturnToService=2:
        a DOWN node returns once its slurmd registers); `idle=False`: not waiting (a job pending
        for the node takes it at once)."""
        self._start_slurmd(self.host(host))
        if idle:
            self._wait_idle(time.monotonic() + timeout)

    # ---- tearing down ---------------------------------------------------------------------

    def close(self) -> None:
        try:
            # SIGKILL: the lab's Slurm state is thrown away, and a slurmd told to stop waits for the
            # steps it still tracks (seconds); what they leave dies with the namespaces (Lab.close).
            for proc in self._daemons:
                if proc.poll() is None:
                    proc.kill()
            for proc in self._daemons:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self._daemons = []
            # slurmstepd ignores SIGTERM: Lab.close would wait 5 s for each before its SIGKILL.
            for h in self.hosts:
                if h.netns:
                    for pid in _sh(["ip", "netns", "pids", h.netns], check=False).stdout.split():
                        with contextlib.suppress(OSError):
                            if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmstepd":
                                os.kill(int(pid), signal.SIGKILL)
        finally:
            super().close()
