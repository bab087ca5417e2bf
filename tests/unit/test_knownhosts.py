"""known_hosts as OpenSSH reads it, and appended to (never rewritten)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import paramiko
import pytest

from dtf.hosts import knownhosts
from dtf.hosts.knownhosts import KnownHosts, append, host_name, parse


def keygen(tmp_path: Path, name: str) -> str:
    """A fresh public key as known_hosts holds it: "type base64"."""
    path = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)], check=True)
    kind, blob = Path(f"{path}.pub").read_text().split()[:2]
    return f"{kind} {blob}"


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    return {n: keygen(tmp_path, n) for n in ("a", "b", "ca", "c")}


def pkey(public: str) -> paramiko.PKey:
    import base64

    kind, blob = public.split()
    return paramiko.PKey.from_type_string(kind, base64.b64decode(blob))


def test_lines_openssh_skips_are_skipped_and_the_rest_is_used(tmp_path: Path, keys: dict[str, str]):
    hashed = paramiko.HostKeys.hash_host("[10.0.0.9]:2222")
    path = tmp_path / "known_hosts"
    path.write_text(
        "# a comment\n"
        "\n"
        f"@cert-authority *.corp.example {keys['ca']}\n"  # a valid CA line: skipped, not an error
        f"a.example {keys['a']}\n"
        "b.example sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29tAAAAIA==\n"
        "c.example ssh-made-up AAAAB3NzaC1yc2E=\n"
        "d.example ssh-ed25519 not*base64!\n"
        "short-line ssh-ed25519\n"
        "@unknown-marker x.example " + keys["b"] + "\n"
        f"{hashed} {keys['b']}\n"
        f"@revoked r.example {keys['c']}\n"
        f"a.example,!bad.a.example,*.wild.example,h?st.example {keys['b']}"  # no final newline
    )
    entries = parse(str(path))
    assert [(e.line, e.revoked) for e in entries] == [(4, False), (10, False), (11, True), (12, False)]
    kh = KnownHosts([str(path)], global_files=[])
    assert [e.line for e in kh.entries("a.example")] == [4, 12]
    assert [e.line for e in kh.entries(host_name("10.0.0.9", 2222))] == [10]
    assert kh.entries("10.0.0.9") == []  # port 22 is another name
    assert [e.line for e in kh.entries("x.wild.example")] == [12]
    assert [e.line for e in kh.entries("HOST.example")] == [12]  # case-insensitive, `?`
    assert kh.entries("hoost.example") == []
    assert kh.entries("x.example") == []  # an unknown marker: the line is skipped
    assert [(e.line, e.revoked) for e in kh.entries("r.example")] == [(11, True)]


def test_a_negated_pattern_excludes_the_host(keys: dict[str, str]):
    line = knownhosts.Entry("f", 1, "*.example,!bad.example", pkey(keys["a"]))
    assert line.matches("good.example") and not line.matches("bad.example")


def test_append_keeps_every_byte_and_adds_one_line(tmp_path: Path, keys: dict[str, str]):
    path = tmp_path / "ssh" / "known_hosts"
    path.parent.mkdir()
    before = f"# mine\n@cert-authority *.corp {keys['ca']}\nother.example {keys['a']}\nweird line without newline"
    path.write_text(before)
    append(str(path), "[10.0.0.5]:2222", pkey(keys["b"]))
    text = path.read_text()
    assert text.startswith(before + "\n")
    assert text[len(before) + 1:] == f"[10.0.0.5]:2222 {keys['b']}\n"
    append(str(path), "h.example", pkey(keys["c"]), hashed=True)
    last = path.read_text().splitlines()[-1]
    assert last.startswith("|1|") and last.endswith(keys["c"])
    assert [e.line for e in KnownHosts([str(path)], []).entries("h.example")] == [6]


def test_append_creates_the_file_private(tmp_path: Path, keys: dict[str, str]):
    path = tmp_path / "new" / ".ssh" / "known_hosts"
    append(str(path), "n.example", pkey(keys["a"]))
    assert path.read_text() == f"n.example {keys['a']}\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_concurrent_appends_give_whole_lines(tmp_path: Path, keys: dict[str, str]):
    path = tmp_path / "known_hosts"
    path.write_text("# keep\n")
    key = pkey(keys["a"])
    threads = [threading.Thread(target=append, args=(str(path), f"h{i}.example", key)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text().splitlines()
    assert lines[0] == "# keep"
    assert sorted(lines[1:]) == sorted(f"h{i}.example {keys['a']}" for i in range(16))
    # The same host from several threads (two hosts behind one jump host): one line.
    threads = [threading.Thread(target=append, args=(str(path), "jump.example", key)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text().count("jump.example") == 1


class _Client:
    """What the policy touches of a paramiko SSHClient."""

    def __init__(self) -> None:
        self.keys = paramiko.HostKeys()
        self.policy: paramiko.MissingHostKeyPolicy | None = None

    def get_host_keys(self) -> paramiko.HostKeys:
        return self.keys

    def set_missing_host_key_policy(self, policy: paramiko.MissingHostKeyPolicy) -> None:
        self.policy = policy


def test_policy_unknown_revoked_changed_and_accept_new(tmp_path: Path, keys: dict[str, str]):
    path = tmp_path / "known_hosts"
    path.write_text(f"@revoked bad.example {keys['c']}\nknown.example {keys['a']}\n")
    strict = KnownHosts([str(path)], [], strict="yes")
    client = _Client()
    strict.install(client, "known.example", 22)  # type: ignore[arg-type]
    assert client.keys.lookup("known.example") is not None  # paramiko compares it itself
    client = _Client()
    strict.install(client, "new.example", 22)  # type: ignore[arg-type]
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        client.policy.missing_host_key(client, "new.example", pkey(keys["b"]))
    client = _Client()
    strict.install(client, "bad.example", 22)  # type: ignore[arg-type]
    with pytest.raises(knownhosts.RevokedHostKey, match=f"marked @revoked in {path}:1"):
        client.policy.missing_host_key(client, "bad.example", pkey(keys["c"]))

    accept = KnownHosts([str(path)], [], strict="accept-new")
    client = _Client()
    accept.install(client, "new.example", 2222)  # type: ignore[arg-type]
    client.policy.missing_host_key(client, "[new.example]:2222", pkey(keys["b"]))
    assert path.read_text().endswith(f"[new.example]:2222 {keys['b']}\n")
    # A revoked key is refused even with accept-new; a host known by another key is "changed".
    client = _Client()
    accept.install(client, "bad.example", 22)  # type: ignore[arg-type]
    with pytest.raises(knownhosts.RevokedHostKey):
        client.policy.missing_host_key(client, "bad.example", pkey(keys["c"]))
    client = _Client()
    accept.install(client, "known.example", 22)  # type: ignore[arg-type]
    with pytest.raises(paramiko.BadHostKeyException):
        client.policy.missing_host_key(client, "known.example", pkey(keys["b"]))
