"""Thirty hosts behind one bastion, fake servers (issue 18): control and failures at scale, against
real sshds: three times MaxStartups' 10 at once. The bastion keeps OpenSSH's defaults
(MaxStartups 10:30:100), and every host is reached through it (ProxyJump). `up` takes its hosts
in turns, each host's deadlines counted from its turn, so a host waiting for its turn is not cut
off. These tests check what happens, never how long it takes: bench/scale.py measures the cost,
and its way of measuring is checked here too (the last test).

The lab of this module is a second lab beside the session's: DTF_SCALE_LAB_NAME and
DTF_SCALE_LAB_SUBNET name it (else it takes a free pair, as a second lab does).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtf.hosts.control import cluster_prefix
from helpers import REPO, Interruptible, assert_one_line_error, dtf, fake_server, status_json, wait_until
from lab import Lab
from sites import listener

pytestmark = pytest.mark.lab

N = 30
CLUSTER = "sc"
FAKE = {"DTF_SERVER": "fake"}


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if os.geteuid() != 0 or not os.access("/usr/sbin/sshd", os.X_OK) or shutil.which("ssh") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the scale lab needs root, sshd and ssh (CI=true)")
        pytest.skip("the scale lab needs root, sshd and ssh")
    name, subnet = os.environ.get("DTF_SCALE_LAB_NAME"), os.environ.get("DTF_SCALE_LAB_SUBNET")
    with Lab(N + 1, root=tmp_path_factory.mktemp("scale"), bastion=True, name=name, subnet=subnet,
             pick=not (name and subnet)) as lab:
        yield lab


@pytest.fixture
def home(tmp_path: Path, big: Lab) -> Iterator[Path]:
    home = tmp_path / "home"
    yield home
    if (home / "state" / f"{CLUSTER}.json").exists():
        dtf("down", home=home, timeout=300)


def names(lab: Lab) -> list[str]:
    return [h.name for h in lab.hosts if h.name != lab.bastion_name]


def inventory(lab: Lab, tmp_path: Path) -> tuple[int, Path]:
    port = lab.ports(1)
    return port[0], lab.inventory(tmp_path / "big.yaml", [{"host": h, **({"ps": port} if i == 0 else {"workers": port})}
                                                 for i, h in enumerate(names(lab))], cluster=CLUSTER)


def env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "DTF_HOME": str(home), "COLUMNS": "200", **FAKE, **(extra or {})}


def accepted(lab: Lab) -> dict[str, int]:
    """SSH logins each sshd of the lab accepted so far (its log, LogLevel VERBOSE)."""
    return {h.name: (lab.root / h.name / "sshd.log").read_text(errors="replace").count("Accepted publickey")
            for h in lab.hosts}


def control_masters(home: Path, channels: bool = False) -> list[tuple[int, str]]:
    """The control masters of this test's cluster (their sockets start with its prefix: other
    tests beside it have masters of their own); with `channels`, their ssh -W channels through a
    jump host's master too."""
    prefix = cluster_prefix(home, CLUSTER)
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(prefix in a for a in argv) and (Path(argv[0]).name == "ssh" or argv[0].startswith("ssh: ")) \
                and (channels or "-W" not in argv):
            found.append((int(pid), " ".join(argv)))
    return found


def nothing_left(lab: Lab, home: Path) -> None:
    assert {h: p for h in names(lab) if (p := lab.processes(h))} == {}
    assert [h for h in names(lab) if (Path(lab.host(h).workdir) / CLUSTER).exists()] == []
    assert not (home / "state" / f"{CLUSTER}.json").exists()
    try:
        wait_until(lambda: not control_masters(home, channels=True), timeout=10)
    except AssertionError:
        raise AssertionError(control_masters(home, channels=True)) from None


def test_thirty_hosts_behind_a_bastion_at_its_defaults_one_handshake_each(big: Lab, home: Path, tmp_path: Path):
    _, inv = inventory(big, tmp_path)
    before = accepted(big)
    r = dtf("up", str(inv), home=home, env=FAKE, timeout=300)
    assert r.returncode == 0, r.stderr
    after = accepted(big)
    new = {h: after[h] - before[h] for h in after}
    assert new.pop(big.bastion_name) == 1  # one master to the bastion, every host's through it
    assert set(new.values()) == {1}, new  # one handshake per host for the whole `up`
    states = [t["state"] for t in status_json(home)["tasks"]]
    assert states == ["alive"] * N
    assert dtf("logs", "worker:3", home=home, timeout=60).returncode == 0
    assert accepted(big) == after  # status and logs: a round trip over the masters, no handshake
    assert len(control_masters(home)) == N + 1
    r = dtf("down", home=home, timeout=300)
    assert r.returncode == 0, r.stderr
    assert accepted(big) == after
    nothing_left(big, home)


def test_each_failed_host_has_its_line_and_the_rest_is_rolled_back(big: Lab, home: Path, tmp_path: Path):
    port, inv = inventory(big, tmp_path)
    busy = ["h4", "h11", "h15"]
    holders = [listener(big, h, port) for h in busy]
    try:
        r = dtf("up", str(inv), home=home, env=FAKE, timeout=300)
    finally:
        for p in holders:
            p.kill()
            p.wait()
    err = assert_one_line_error(r, 4, "dtf up failed on 3 host(s)")
    report = err[err.index("dtf: error:"):].splitlines()[1:]
    failed = [line.split(":")[0].strip() for line in report if line.startswith("  ")]
    assert failed == busy, err
    assert all(f"{h}: port busy: {port} (worker:" in err for h in busy)
    nothing_left(big, home)


def test_a_host_that_never_answers_is_cut_off_by_its_deadline(big: Lab, home: Path, tmp_path: Path):
    """Its sshd is stopped (SIGSTOP): TCP connects, no banner ever comes. `up` names it and rolls
    the others back, without waiting for anything but that host's connect timeout."""
    _, inv = inventory(big, tmp_path)
    sshd = big.host("h7").proc
    assert sshd is not None
    os.kill(sshd.pid, signal.SIGSTOP)
    try:
        r = dtf("up", str(inv), "--connect-timeout", "3", home=home, env=FAKE, timeout=300)
    finally:
        os.kill(sshd.pid, signal.SIGCONT)
    err = assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", "h7: unreachable: no answer from")
    assert "within 3s" in err
    nothing_left(big, home)


def test_ctrl_c_while_hosts_are_at_every_step_leaves_nothing(big: Lab, home: Path, tmp_path: Path):
    """Ctrl-C lands while one host is still connecting (its sshd stopped), the others starting
    servers that serve only once the test released them: every host is rolled back."""
    _, inv = inventory(big, tmp_path)
    release = tmp_path / "release"
    sshd = big.host("h12").proc
    assert sshd is not None
    os.kill(sshd.pid, signal.SIGSTOP)
    up = Interruptible("up", str(inv), "--connect-timeout", "5",
                       env=env(home, {"DTF_SERVER": f"fake:ready_file={release}"}))
    try:
        up.wait_for("starting ")
        wait_until(lambda: any(fake_server(*p) for h in names(big) for p in big.processes(h)), timeout=60)
        up.ctrl_c()
    finally:
        release.write_text("")
        os.kill(sshd.pid, signal.SIGCONT)
    code, err = up.finish(timeout=120)
    assert code == 130, err
    assert "Traceback" not in err and "dtf: error: interrupted" in err
    nothing_left(big, home)


def test_the_benchmark_counts_the_laptop_and_each_host_apart(big: Lab, monkeypatch: pytest.MonkeyPatch):
    """bench/scale.py's accounting: the CPU of what the laptop starts lands in the laptop's
    control group, a host's SSH session's (sshd's, and the command it runs) in that host's, and
    no sshd is ever in the laptop's."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from cpugroups import CpuGroups, unavailable
    from scale import Meter, floor

    if why := unavailable():
        pytest.skip(f"no control group to account CPU in: {why}")
    with CpuGroups() as groups:
        meter = Meter(groups, big)
        hosts = names(big)
        before = accepted(big)
        figure = floor(meter, hosts, "pass", "-o", "ProxyJump=none")
        meter.check_apart()
        assert figure.laptop_s > 0
        assert [h for h, spent in zip(hosts, figure.hosts_s) if spent <= 0] == []
        # The bastion served no login (its listening sshd may still spend a little CPU reaping
        # sessions that earlier tests left, so its log says it, not its group's CPU).
        after = accepted(big)
        assert [h.name for h in big.hosts if h.name not in hosts and after[h.name] != before[h.name]] == []
    assert not groups.parent.exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
