"""Control at the SSH floor: one OpenSSH master per host, opened once and kept for the cluster's life.

Every command dtf runs on a host (`up`'s steps, `status`, `logs`, `sync`, `down`, the lease's
renewals) is a session over that host's master: a round trip, not a handshake. A master is
started by the first command that finds none (ssh `-M -N -f`, stderr to a log file) and stays
`ControlPersist` seconds after its last use: the cluster's lease (its ttl), so a killed laptop
leaves none running beyond the lease; `dtf down` closes them (`close_control`).

Jump hosts (ProxyJump): each hop gets one master per cluster, shared by every host behind it (the
next hop reached with `ssh -S HOP -W`): 100 hosts behind a bastion make one connection to it,
not 100 unauthenticated ones at once (sshd's MaxStartups 10:30:100 drops those).

Where no `ssh` binary exists, dtf.hosts.connections gives the paramiko runner (a handshake per connection).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from dtf.cluster.inventory import HostSpec
from dtf.hosts.base import (
    COMMAND_TIMEOUT,
    CommandRunner,
    Conversation,
    HostError,
    LineStream,
    Output,
    Readable,
    Result,
    feed_process,
    process_lines,
    process_output,
    read_process,
    temporary_name,
)
from dtf.hosts.masters import Master, MasterFailed, listening, parallel, stop_master
from dtf.hosts.mux import SSH_FAILED, MuxProcess, MuxRefused
from dtf.hosts.mux import enabled as mux_enabled
from dtf.hosts.netutil import CONNECT_TIMEOUT
from dtf.hosts.programs import script
from dtf.hosts.shell import render
from dtf.hosts.trees import fetch_by_tar

# put_and_converse's python on the host: it writes the upload, then runs it as a zipapp.
_BOOT = script("boot.py")
_PUT = script("put.sh")  # sh: stdin written to a file atomically, then (put_then_run) a command
NEVER_PERSIST = 3600  # ControlPersist for a cluster whose lease never lapses: opened again when needed
ALIVE = 5  # ServerAliveInterval of a control master: a host cut off ends it (and its commands)
# after openssh.ALIVE_COUNT intervals unanswered


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def control_dir() -> Path:
    """Where the control masters keep their sockets: short (a Unix socket path has ~100 bytes), and
    apart from `dtf train`'s masters (dtf.hosts.tunnel), which end with the program."""
    return Path(tempfile.gettempdir()) / f"dtf-ctl-{os.getuid()}"


def cluster_prefix(home: Path, cluster: str) -> str:
    """Every control socket of one cluster starts with this (`close_control` finds them by it)."""
    return str(control_dir() / f"c{_key(str(home), cluster)}")


def host_path(home: Path, cluster: str, host: str) -> str:
    return f"{cluster_prefix(home, cluster)}-{_key(host)}"


def hop_path(home: Path, cluster: str, hop: HostSpec) -> str:
    return f"{cluster_prefix(home, cluster)}-j{_key(hop.user or '', hop.host, str(hop.port or ''))}"


def persist_for(ttl: float) -> int:
    return max(10, round(ttl)) if ttl > 0 else NEVER_PERSIST


def cluster_master(ssh: str, spec: HostSpec, home: Path, cluster: str, ssh_config: str | None,
                   connect_timeout: float = CONNECT_TIMEOUT, ttl: float = 0, session: bool = False) -> Master:
    """The cluster's master to a host (not started): every command of dtf goes over it, and
    `dtf train`'s ssh mode carries its connections over it too (`session`: run the empty session
    when it starts, for the TCP_NODELAY of dtf.hosts.tunnel; a command's own session does that)."""
    return Master(ssh, spec, ssh_config, host_path(home, cluster, spec.host), connect_timeout,
                  persist=persist_for(ttl), hop_path=lambda hop: hop_path(home, cluster, hop),
                  session=session, alive=ALIVE)


def reason(failed: MasterFailed, target: str, identity: str | None, timeout: float,
           jump: bool | None = None) -> str:
    """ssh's failure as dtf's one-line reasons (the same as the paramiko runner's)."""
    lines = [s.strip() for s in failed.log.splitlines() if s.strip()]
    last = lines[-1] if lines else str(failed)
    text = failed.log
    if jump is None:  # which master failed: the host's, or one of its jump hosts'
        jump = failed.spec.host not in target
    where = f"jump host {failed.spec.host} of {target}" if jump else target
    if "REVOKED" in text:
        return f"the host key of {where} is marked @revoked: refusing to connect"
    if "IDENTIFICATION HAS CHANGED" in text or ("Host key for" in text and "has changed" in text):
        return f"host key of {where} does not match known_hosts: refusing to connect"
    if "Host key verification failed" in text:
        return (f"host key of {where} is unknown: add it to known_hosts (ssh once to "
                f"{failed.spec.host}) or set StrictHostKeyChecking accept-new")
    if "Permission denied" in text:
        return f"authentication refused for {where} (tried {identity or 'agent and default keys'}): {last}"
    if failed.timed_out or "timed out" in text:
        return f"unreachable: no answer from {where} within {timeout:g}s"
    if "Could not resolve hostname" in text:
        return f"unreachable: cannot resolve {failed.spec.host}: {last.rpartition(': ')[2]}"
    # `ssh: connect to host H port P: REASON`: the system's reason, as it is (Connection refused: no
    # sshd there; No route to host: nothing answers for that address; Network is unreachable).
    m = re.search(r"connect to host \S+ port \d+: (.+)$", text, re.M)
    if m:
        return f"unreachable: {where}: {m.group(1)}"
    return f"SSH to {where} failed: {last}"


class OpenSSHRunner(CommandRunner):
    """SSH over the host's master (see the module's doc); commands are `ssh -S PATH HOST CMD`.
    Every command, stream, file and check goes over the master: OpenSSH is the only SSH client
    of a run (ParamikoRunner, dtf.hosts.paramikossh, is for where there is no `ssh`)."""

    converses = True

    def __init__(self, master: Master) -> None:
        super().__init__(master.spec)
        self.ssh_config_path = master.ssh_config
        self.connect_timeout = master.connect_timeout
        self.ssh = master.ssh
        self.master = master

    def _target(self) -> str:
        """user@address:port as OpenSSH resolves them (`ssh -G`: read, no network), for messages."""
        from dtf.hosts.openssh import settings

        found = settings(self.ssh, self.spec, self.ssh_config_path)
        target = (f"{found.get('user') or self.spec.user or '?'}@{found.get('hostname') or self.spec.host}:"
                  f"{found.get('port') or self.spec.port or 22}")
        hop = found.get("proxyjump", "")
        if hop and hop.lower() != "none":
            target += f" (via {hop.split(',')[0]})"
        return target

    def open(self) -> None:
        if listening(self.master.path):
            return
        with self.master.lock:
            if listening(self.master.path):
                return
            try:
                self.master.start()
            except MasterFailed as e:
                if "REVOKED" in e.log and e.spec is self.spec:
                    raise HostError(self._revoked())
                raise HostError(reason(e, self._target(), self.spec.identity_file, self.connect_timeout,
                                       jump=e.spec is not self.spec))

    def _revoked(self) -> str:
        """OpenSSH refused the host's revoked key: name the known_hosts line that marks it, as
        dtf.hosts.knownhosts does for the paramiko runner."""
        from dtf.hosts.knownhosts import KnownHosts, host_name
        from dtf.hosts.openssh import settings

        found = settings(self.ssh, self.spec, self.ssh_config_path)  # (OpenSSH's reading: `ssh -G`)
        port = found.get("port") or str(self.spec.port or 22)
        name = host_name(found.get("hostname") or self.spec.host, int(port) if port.isdigit() else 22)
        marks = [e for e in KnownHosts.from_ssh_config(found).entries(name) if e.revoked]
        where = f" in {marks[0].where}" if marks else ""
        return f"the host key of {name} is marked @revoked{where}: refusing to connect"

    def close(self) -> None:
        pass  # the master stays: it is the cluster's

    def master_path(self) -> str | None:
        return self.master.path

    def command(self, *options: str) -> list[str]:
        """ssh over the master; ControlMaster=no: never become a master of its own by accident."""
        # LogLevel=ERROR: no "Shared connection to HOST closed." after a session with a pty.
        return [self.ssh, "-S", self.master.path, "-o", "ControlMaster=no", "-o", "BatchMode=yes",
                "-o", "LogLevel=ERROR", "-o", f"ConnectTimeout={max(1, round(self.connect_timeout))}", *options,
                self.spec.host]

    def result(self, proc_result: Result) -> Result:
        """A command's Result; HostError where ssh failed because the master is gone."""
        if proc_result.exit_code == SSH_FAILED and not listening(self.master.path):
            err = (proc_result.stderr.strip().splitlines() or ["the master connection closed"])[-1]
            raise HostError(f"unreachable: the SSH connection to {self._target()} was lost: {err}")
        return proc_result

    def run(self, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT, stdin: bytes | None = None,
            named: Sequence[str] | None = None) -> Result:
        """Run argv over the master (`named`: the command its errors name, when argv wraps it)."""
        self.open()
        command, full = render(argv), self.command() + [render(argv)]
        argv = named or argv
        if mux_enabled():  # asked of the master: no ssh process per host and command (`status`, `down`)
            with contextlib.suppress(MuxRefused):
                return self.result(self._mux_run(command, stdin or b"", timeout, argv))
        try:
            p = subprocess.run(full, input=stdin if stdin is not None else b"", capture_output=True,
                               timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise HostError(f"command timed out after {timeout:g}s: {argv[0]} {' '.join(argv[2:3])}")
        except OSError as e:
            raise HostError(f"cannot run {self.ssh}: {e.strerror or e}")
        return self.result(Result(p.returncode, p.stdout.decode(errors="replace"),
                                         p.stderr.decode(errors="replace")))

    def _mux_run(self, command: str, stdin: bytes, timeout: float, named: Sequence[str]) -> Result:
        """`command` as a session of the master (dtf.hosts.mux), `stdin` written to it and its
        output read whole, as `run`'s ssh does; MuxRefused where the master did not take it."""
        proc = MuxProcess(self.master.path, command)
        out: list[bytes] = []
        err: list[bytes] = []

        def write() -> None:
            with contextlib.suppress(OSError):  # (it ended early: its exit status and stderr say why)
                proc.stdin.write(stdin)
            with contextlib.suppress(OSError):
                proc.stdin.close()

        threads = [threading.Thread(target=write, daemon=True, name="dtf-run-in"),
                   threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True, name="dtf-run-out"),
                   threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True, name="dtf-run-err")]
        for thread in threads:
            thread.start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Its readers are not waited for: the master keeps the session's pipes open until the
            # command ends (a command outlives a killed ssh client too).
            proc.kill()
            raise HostError(f"command timed out after {timeout:g}s: {named[0]} {' '.join(named[2:3])}")
        for thread in threads:
            thread.join(5)  # (the master has closed the session's pipes by the time it says the end)
        for f in (proc.stdout, proc.stderr):
            f.close()
        return Result(code, b"".join(out).decode(errors="replace"),
                      b"".join(err).decode(errors="replace") + (f"{proc.message}\n" if proc.message else ""))

    @staticmethod
    def _put(remote_dir: str, filename: str, *then: str) -> list[str]:
        """put.sh's command line: stdin to remote_dir/filename, atomically, then `then`."""
        return ["sh", "-c", _PUT, "sh", remote_dir, filename, temporary_name(filename), *then]

    def put_bytes(self, data: bytes, remote_dir: str, filename: str) -> None:
        r = self.run(self._put(remote_dir, filename), stdin=data)
        if not r.ok:
            raise HostError(f"upload to {remote_dir} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")

    def run_with_input(self, argv: Sequence[str], data: bytes, timeout: float = COMMAND_TIMEOUT,
                       named: Sequence[str] | None = None) -> Result:
        return self.run(argv, timeout=timeout, stdin=data, named=named)

    def put_then_run(self, data: bytes, remote_dir: str, filename: str, argv: Sequence[str],
                     timeout: float = COMMAND_TIMEOUT) -> Result:
        """Upload a file and run a command, in one round trip (the launcher, then its `check`)."""
        return self.run(self._put(remote_dir, filename, *argv), timeout=timeout, stdin=data, named=argv)

    def put_and_converse(self, data: bytes, remote_dir: str, filename: str, argv: Sequence[str]) -> Conversation:
        """put_then_run's upload and command in one round trip, the command's stdin kept open
        (Conversation). The host's python reads the upload itself, to the byte (`cat` would read
        to the end of stdin), writes it atomically, then runs it as `python FILE ARGS` would: argv
        is [python, remote_dir/filename, ARGS]."""
        path, tmp = f"{remote_dir}/{filename}", f"{remote_dir}/{temporary_name(filename)}"
        return self.converse([argv[0], "-c", _BOOT, str(len(data)), path, tmp, *argv[2:]], data)

    def converse(self, argv: Sequence[str], data: bytes) -> Conversation:
        """argv over the master, `data` on its stdin, its output read a line at a time as it comes:
        asked of the master itself (dtf.hosts.mux: no ssh process per host), or where it does not
        take it or DTF_SSH_MUX=0, through ssh's own mux client."""
        self.open()
        if mux_enabled():
            try:
                return Conversation([], data, proc=MuxProcess(self.master.path, render(argv)))
            except MuxRefused:
                pass
        try:
            return Conversation(self.command() + [render(argv)], data)
        except OSError as e:
            raise HostError(f"cannot run {self.ssh}: {e.strerror or e}")

    def put_file(self, local: Path, remote_dir: str, filename: str) -> None:
        with open(local, "rb") as f:
            r = self.feed(self._put(remote_dir, filename), f)
        if not r.ok:
            raise HostError(f"upload of {local.name} to {remote_dir} failed: "
                            f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")

    def feed(self, argv: Sequence[str], source: Readable, stall: float = COMMAND_TIMEOUT,
             sent: Callable[[int], None] = lambda n: None) -> Result:
        self.open()
        return self.result(feed_process(self.command("-T") + [render(argv)], source, stall, sent))

    def stream(self, argv: Sequence[str]) -> int:
        """The command's output here as it comes, until it ends or Ctrl-C (130): a pty, so that
        closing the session (Ctrl-C ends our ssh) sends the remote command SIGHUP."""
        self.open()
        try:
            return subprocess.call(self.command("-tt") + [render(argv)], stdin=subprocess.DEVNULL)
        except KeyboardInterrupt:
            return 130

    def lines(self, argv: Sequence[str]) -> LineStream:
        """The command's stdout line by line (a launcher's `top`), as a session of the master: no
        new handshake. Closing it ends our ssh client; the remote command's next write then fails."""
        self.open()
        try:
            return process_lines(self.command("-T") + [render(argv)])
        except OSError as e:
            raise HostError(f"cannot run {self.ssh}: {e.strerror or e}")

    def reaches(self, target: str, timeout: float) -> bool:
        """Whether the host opens a TCP connection to `target`, asked over the master (`ssh -W`):
        the master answers its client "session opened" only once the host confirmed the channel
        (OpenSSH's mux_stdio_confirm), which `-v` prints; a refused channel ends the client."""
        self.open()
        try:
            proc = subprocess.Popen(self.command("-v", "-W", target), stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except OSError:
            return False
        assert proc.stderr is not None
        opened = threading.Event()

        def watch() -> None:
            assert proc.stderr is not None
            for line in iter(proc.stderr.readline, b""):
                if b"master session id" in line:
                    opened.set()
                    return

        reader = threading.Thread(target=watch, daemon=True, name="dtf-reach")
        reader.start()
        try:
            reader.join(timeout)  # the line, or the client's end (a refused channel), or the deadline
            return opened.is_set()
        finally:
            proc.kill()
            proc.wait()
            with contextlib.suppress(OSError):
                proc.stdin.close()  # type: ignore[union-attr]
                proc.stderr.close()

    def output(self, argv: Sequence[str]) -> Output:
        """The command's stdout and stderr as they come (a collective copy's `follow`): a session
        of the master. Closing it ends our ssh client."""
        self.open()
        return process_output(self.command("-T") + [render(argv)])

    def read_output(self, argv: Sequence[str], timeout: float) -> tuple[bytes, int, str]:
        self.open()
        return read_process(self.command("-T") + [render(argv)], timeout)

    def fetch_tree(self, remote: str, local: Path) -> int:
        """A tar on a session's stdout (dtf.hosts.trees): over the master, no SFTP client."""
        return fetch_by_tar(self, remote, local)


def close_control(home: Path, cluster: str) -> int:
    """Close every master of the cluster (the hosts' first, then their jump hosts'); how many ran."""
    from dtf.hosts.openssh import ssh_binary

    ssh = ssh_binary()
    if not ssh:
        return 0
    found = glob.glob(glob.escape(cluster_prefix(home, cluster)) + "-*")
    paths = [p for p in found if not p.endswith(".log")]
    hosts = [p for p in paths if not os.path.basename(p).split("-", 1)[1].startswith("j")]
    hops = [p for p in paths if p not in hosts]
    for group in (hosts, hops):
        parallel([functools.partial(stop_master, ssh, p) for p in group])
    for p in found:  # the logs too, a failed start's included
        with contextlib.suppress(OSError):
            os.unlink(p if p.endswith(".log") else p + ".log")
    return len(paths)
