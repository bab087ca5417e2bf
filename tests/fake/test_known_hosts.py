"""Host keys on the SSH lab, read and written as OpenSSH does (dtf.hosts.knownhosts), against real sshd:
certificate-authority lines are skipped, a new host's key is appended with accept-new and every
other line is kept byte for byte, a revoked key is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from sites import LabSite

pytestmark = pytest.mark.lab


@pytest.fixture
def site(tmp_path: Path, lab) -> LabSite:
    s = LabSite(tmp_path, lab)
    yield s
    s.cleanup()


def ca_line(tmp_path: Path) -> str:
    key = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "corp-ca", "-f", str(key)], check=True)
    return f"@cert-authority *.corp.example {Path(f'{key}.pub').read_text().strip()}"


def with_known_hosts(site: LabSite, inv: Path, known: Path, strict: str) -> None:
    """Point the inventory's ssh_config at `known` with that StrictHostKeyChecking."""
    config = site.tmp / "ssh_config"
    text = Path(site.lab.ssh_config).read_text().replace(str(site.lab.known_hosts), str(known))
    config.write_text(text.replace("StrictHostKeyChecking yes", f"StrictHostKeyChecking {strict}"))
    inv.write_text(inv.read_text().replace(str(site.lab.ssh_config), str(config)))


def lab_lines(site: LabSite) -> list[str]:
    """The lab's known_hosts lines of hosts h0 and h1."""
    addresses = [site.lab.host(n).address for n in ("h0", "h1")]
    return [line for line in site.lab.known_hosts.read_text().splitlines()
            if any(a in line.split()[0] for a in addresses)]


def test_a_cert_authority_line_and_comments_are_skipped(site: LabSite, tmp_path: Path):
    known = tmp_path / "known_hosts"
    known.write_text("# the company's CA\n" + ca_line(tmp_path) + "\n" + site.lab.known_hosts.read_text())
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    with_known_hosts(site, inv, known, "yes")
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    assert site.dtf("down").returncode == 0


def test_accept_new_appends_and_keeps_every_other_line(site: LabSite, tmp_path: Path):
    known = tmp_path / "known_hosts"
    other = "other.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBV0a3H3Kxm6HmfMh4Ct4aZJQ6VyQ9BIYd0Yz5q3nGGZ"
    before = f"# mine: keep me\n{ca_line(tmp_path)}\n{other}\nsomething.example ssh-future-type AAAA\n"
    known.write_text(before)
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    with_known_hosts(site, inv, known, "accept-new")
    r = site.dtf("up", str(inv))
    assert r.returncode == 0, r.stderr
    text = known.read_text()
    assert text.startswith(before)  # byte for byte
    added = text[len(before):].splitlines()
    # One line per new host, in OpenSSH's format: the same keys the lab's own file holds.
    assert sorted(line.split(None, 1)[1] for line in added) == sorted(
        line.split(None, 1)[1] for line in lab_lines(site))
    assert len(added) == 2
    # Known now: a second down/up adds nothing.
    assert site.dtf("down").returncode == 0
    assert site.dtf("up", str(inv)).returncode == 0
    assert known.read_text() == text


def test_a_revoked_key_is_refused(site: LabSite, tmp_path: Path):
    known = tmp_path / "known_hosts"
    lines = site.lab.known_hosts.read_text().splitlines()
    h1 = site.lab.host("h1").address
    known.write_text("\n".join(f"@revoked {line}" if h1 in line.split()[0] else line for line in lines) + "\n")
    inv = site.inventory({"a": {"ps": 1}, "b": {"workers": 1}})
    with_known_hosts(site, inv, known, "accept-new")  # revoked means never, even with accept-new
    r = site.dtf("up", str(inv))
    assert_one_line_error(r, 4, "dtf up failed on 1 host(s)", f"h1: the host key of {h1}",
                          f"is marked @revoked in {known}:")
    assert site.processes() == [] and site.files() == []
