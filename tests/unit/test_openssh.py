"""OpenSSH's settings for the hosts (`ssh -G`), read at once and once (dtf.hosts.openssh)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtf.cluster.inventory import HostSpec
from dtf.hosts import openssh


def _spec(host: str) -> HostSpec:
    return HostSpec(host=host, line=1, connection="ssh", user=None, port=None, identity_file=None,
                    python="python3", workdir="~/.dtf", address=None, ps_ports=(), worker_ports=(2222,))


def test_a_hosts_settings_being_read_are_waited_for_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A host whose `ssh -G` another thread runs is waited for: a second prefetch of the same hosts
    starts none of its own."""
    log, barrier = tmp_path / "runs", tmp_path / "go"
    ssh = tmp_path / "ssh"  # `ssh -G HOST`: logged, then held until the barrier is there (20 s at most)
    ssh.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\n"
                   f"for i in $(seq 200); do [ -e {barrier} ] && break; sleep 0.1; done\n"
                   "for last; do :; done\nprintf 'hostname 10.0.0.%s\\nuser u\\n' \"${last#h}\"\n")
    ssh.chmod(0o755)
    monkeypatch.setenv(openssh.SSH_ENV, str(ssh))
    monkeypatch.setattr(openssh, "_settings", {})
    specs = [_spec(f"h{i}") for i in range(4)]

    class Releasing(threading.Event):
        """The first wait for another thread's `ssh -G` lets them answer."""

        def wait(self, timeout: float | None = None) -> bool:
            barrier.touch()
            return super().wait(timeout)

    monkeypatch.setattr(openssh, "threading", SimpleNamespace(Event=Releasing))  # (prefetch's events only)
    early = threading.Thread(target=openssh.prefetch, args=(str(ssh), specs, None))
    early.start()
    deadline = threading.Event()
    for _ in range(400):  # until the early ones run (each logs itself first)
        if log.exists() and len(log.read_text().splitlines()) == 4:
            break
        deadline.wait(0.05)
    assert len(log.read_text().splitlines()) == 4
    openssh.prefetch(str(ssh), specs, None)  # all four in flight: waited for (which releases them)
    early.join(30)
    assert not early.is_alive()
    assert sorted(log.read_text().split("\n")[:-1]) == sorted(f"-o BatchMode=yes -o ConnectTimeout=10 -o "
                                                              f"ServerAliveInterval=15 -o ServerAliveCountMax=3 "
                                                              f"-G h{i}" for i in range(4))
    assert [openssh.settings(str(ssh), s, None)["hostname"] for s in specs] == [f"10.0.0.{i}" for i in range(4)]
    assert len(log.read_text().splitlines()) == 4  # (settings: from what was read)
    assert openssh._inflight == {}
