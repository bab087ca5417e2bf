"""A master's start interrupted (Ctrl-C) leaves no ssh behind: neither the one still connecting
nor a master it forked just before. A stand-in `ssh` plays OpenSSH's part: it connects until the
test lets it, then forks a "master" listening on the control socket, answers `-O check` and
`-O exit`, and records each process id it starts."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts import masters
from helpers import wait_gone, wait_until

SPEC = HostSpec(host="h7", line=3, connection="ssh", user=None, port=None, identity_file=None,
                python="python3", workdir="~", address=None, ps_ports=(), worker_ports=())

# The master: a listener on the control socket, in a session of its own (as `-f` leaves it).
LISTEN = ("import os,socket,sys,time; os.setsid(); s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]);"
          " s.listen(); time.sleep(120)")

SSH = """#!/bin/sh
dir={dir}
case " $* " in *" -G "*) exit 0;; esac
for a in "$@"; do case $a in ControlPath=*) path=${{a#ControlPath=}};; -S) socket=1;; esac; done
if [ -n "$socket" ]; then  # -S PATH -O check|exit
    case " $* " in
        *" check "*) echo "Master running (pid=$(cat "$dir/master.pid"))" >&2;;
        *" exit "*) kill "$(cat "$dir/master.pid")"; echo "Exit request sent." >&2;;
    esac
    exit 0
fi
echo $$ > "$dir/ssh.pid"
i=0
while [ ! -e "$dir/go" ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done  # the handshake, until the test ends it
{python} -c '{listen}' "$path" & echo $! > "$dir/master.pid"
while [ ! -S "$path" ]; do sleep 0.02; done
exit 0
"""


def fake_ssh(tmp_path: Path) -> str:
    ssh = tmp_path / "ssh"
    ssh.write_text(SSH.format(dir=tmp_path, python=sys.executable, listen=LISTEN))
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    return str(ssh)


def interrupt_the_handshake(monkeypatch: pytest.MonkeyPatch, before: Callable[[subprocess.Popen[bytes]], object]) -> None:
    """Ctrl-C during start()'s wait for ssh: `before(proc)` runs first (the ssh still connecting,
    or done), then the wait raises KeyboardInterrupt, as Python's SIGINT handler would."""
    start = masters.start_master

    def started(argv: list[str], path: str) -> subprocess.Popen[bytes]:
        proc = start(argv, path)
        wait = proc.wait

        def interrupted(timeout: float | None = None) -> int:  # the first wait only
            proc.wait = wait  # type: ignore[method-assign]
            before(proc)
            raise KeyboardInterrupt

        proc.wait = interrupted  # type: ignore[method-assign]
        return proc

    monkeypatch.setattr(masters, "start_master", started)


@pytest.fixture
def master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> masters.Master:
    monkeypatch.setenv(masters.mux.SWITCH, "0")  # the stand-in answers `ssh -O`, not the mux protocol
    path = str(tmp_path / "ctl" / "c-h7")
    return masters.Master(fake_ssh(tmp_path), SPEC, None, path, connect_timeout=5, session=False)


def test_ctrl_c_while_ssh_connects_ends_that_ssh(master: masters.Master, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    interrupt_the_handshake(monkeypatch, lambda proc: wait_until(lambda: (tmp_path / "ssh.pid").exists()))
    with pytest.raises(KeyboardInterrupt):
        master.start()
    pid = int((tmp_path / "ssh.pid").read_text())
    wait_gone([pid], timeout=10)  # ended by start(): left alone, it would connect and fork a master
    assert not os.path.exists(master.path)


def test_ctrl_c_just_after_ssh_forked_its_master_closes_that_master(master: masters.Master, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    def forked(proc: subprocess.Popen[bytes]) -> None:
        (tmp_path / "go").touch()
        wait_until(lambda: proc.poll() is not None, timeout=30)  # ssh has exited: its master runs

    interrupt_the_handshake(monkeypatch, forked)
    with pytest.raises(KeyboardInterrupt):
        master.start()
    pid = int((tmp_path / "master.pid").read_text())
    wait_gone([pid], timeout=10)  # closed by start(): left alone, it would stay for ControlPersist
    assert not os.path.exists(master.path)
