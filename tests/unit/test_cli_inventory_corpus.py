"""Malformed and hostile inventories through the command line, as a user meets them.

test_inventory.py checks `loads()`; this checks what `dtf up --dry-run FILE` prints and exits
with: one mistake per inventory, so exactly one line `dtf: error: FILE:LINE:COL: ...`, exit
code 3, never a traceback. Values with shell characters that are valid (paths) must come out
shell-quoted in the start command the dry run prints. A property test feeds random YAML.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dtf.cli import app
from dtf.files.shipping import launcher_name
from helpers import dtf

runner = CliRunner()
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
OK_HOSTS = "hosts:\n  - {host: gpu-01, ps: 1, workers: 1}\n"
SHELL = "without quotes or shell characters such as ; $ ` ( ) < > |"
NAME = "expected a cluster name of at most 63 letters, digits, '_', '.' or '-', starting with a letter or digit"
COUNT = "expected a whole number >= 0 or a list of ports"
PORT = "expected a port number 1..65535"
LIMIT = "expected a whole number 0..1000000"
BACKOFF = "expected a number of seconds 0..3600"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DTF_HOME, HOME (ssh_config lookups) and the working directory all in tmp_path."""
    monkeypatch.setenv("DTF_HOME", str(tmp_path / "dtf-home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def host(entry: str) -> str:
    """An inventory whose only mistake is in `entry`, the second host (line 4)."""
    return f"cluster: demo\nhosts:\n  - {{host: gpu-01, ps: 1, workers: 1}}\n  - {entry}\n"


# (id, inventory text or bytes, what follows "dtf: error: FILE:"). One mistake each: one line.
CORPUS: list[tuple[str, str | bytes, str]] = [
    # -- bad YAML: the parser stops at the first problem
    ("tab-indent", "cluster: demo\nhosts:\n\t- {host: a, ps: 1, workers: 1}\n",
     "3:1: invalid YAML: found character '\\t' that cannot start any token (indent with spaces, not tabs)"),
    ("unclosed-flow", "cluster: demo\nhosts: [\n", "3:1: invalid YAML: expected the node content, but found '<stream end>'"),
    ("unclosed-quote", "cluster: 'demo\n" + OK_HOSTS, "4:1: invalid YAML: found unexpected end of stream"),
    ("bad-indent", "cluster: demo\n  hosts: x\n", "2:8: invalid YAML: mapping values are not allowed here"),
    ("two-documents", "cluster: demo\n" + OK_HOSTS + "---\ncluster: other\n",
     "4:1: invalid YAML: expected a single document in the stream, but found another document"),
    ("undefined-alias", "cluster: *name\n" + OK_HOSTS, "1:10: invalid YAML: found undefined alias 'name'"),
    ("nul-byte", "cluster: demo\x00\n" + OK_HOSTS,
     "1:14: invalid YAML: unacceptable character #x0000 (special characters are not allowed)"),
    ("escape-char-cr-lines", "cluster: demo\rhosts: \x1b[2J\r",
     "2:8: invalid YAML: unacceptable character #x001b (special characters are not allowed)"),
    ("nested-too-deeply", "[" * 100_000, "1:1: invalid YAML: nested too deeply"),
    ("not-utf8", b"cluster: demo\nhosts:\n  - {host: \xff\xfe, ps: 1, workers: 1}\n", "3:12: cannot read file: not UTF-8 text"),
    # -- the document itself
    ("empty-file", "", "1:1: the file is empty; expected a mapping with keys cluster and hosts"),
    ("only-comments", "# cluster: demo\n", "1:1: the file is empty; expected a mapping with keys cluster and hosts"),
    ("top-level-list", "- cluster: demo\n", "1:1: expected a mapping with keys cluster and hosts, got a list"),
    ("python-tag-document", "!!python/object/apply:os.system ['touch pwned']\n",
     "1:1: expected a mapping with keys cluster and hosts, got a value with the unsupported tag '!!python/object/apply:os.system'"),
    # -- wrong types
    ("hosts-mapping", "cluster: demo\nhosts: {host: gpu-01, ps: 1, workers: 1}\n", "2:1: hosts: expected a non-empty list of hosts, got a mapping"),
    ("hosts-empty", "cluster: demo\nhosts: []\n", "2:1: hosts: expected a non-empty list of hosts, got an empty list"),
    ("host-entry-string", host("gpu-02"), "4:5: hosts[1]: expected a mapping with at least a host key, got 'gpu-02'"),
    ("workers-word", host("{host: b, workers: two}"), f"4:15: hosts[1].workers: {COUNT}, got 'two'"),
    ("workers-float", host("{host: b, workers: 1.5}"), f"4:15: hosts[1].workers: {COUNT}, got 1.5"),
    ("port-boolean", host("{host: b, port: yes}"), f"4:15: hosts[1].port: {PORT}, got a boolean (yes)"),
    ("port-string", host("{host: b, port: '22'}"), f"4:15: hosts[1].port: {PORT}, got '22'"),
    ("tf-port-list", host("{host: b, tf_port: [2222]}"), f"4:15: hosts[1].tf_port: {PORT}, got a list"),
    ("user-number", "cluster: demo\ndefaults:\n  user: 1001\n" + OK_HOSTS, "3:3: defaults.user: expected a user name, got 1001"),
    ("defaults-list", "cluster: demo\ndefaults: [user]\n" + OK_HOSTS, "2:1: defaults: expected a mapping of host settings, got a list"),
    ("connection-typo", host("{host: b, connection: sshh}"), "4:15: hosts[1].connection: expected 'ssh' or 'local', got 'sshh'"),
    ("python-number", host("{host: b, python: 3}"), "4:15: hosts[1].python: expected a path, got 3"),
    ("workdir-date", host("{host: b, workdir: 2024-01-01}"), "4:15: hosts[1].workdir: expected a path, got a date (2024-01-01)"),
    ("cluster-number", "cluster: 42\n" + OK_HOSTS, "1:1: cluster: expected a cluster name, got 42"),
    ("user-python-tag", host("{host: b, user: !!python/object/apply:os.system [id]}"),
     "4:15: hosts[1].user: unsupported YAML tag '!!python/object/apply:os.system'"),
    ("port-bad-int-tag", host("{host: b, port: !!int ''}"), "4:15: hosts[1].port: invalid !!int value ''"),
    # -- missing keys
    ("missing-cluster", OK_HOSTS, "1:1: missing required key 'cluster'"),
    ("missing-hosts", "cluster: demo\n", "1:1: missing required key 'hosts'"),
    ("missing-host", host("{ps: 1}"), "4:5: hosts[1]: missing required key 'host'"),
    ("no-worker", "cluster: demo\nhosts:\n  - {host: gpu-01, ps: 1}\n",
     "2:1: hosts: no worker task: at least one host needs workers: 1 or more"),
    # -- unknown, misplaced and duplicate keys
    ("unknown-top-key", "cluster: demo\n" + OK_HOSTS + "extra: 1\n", "4:1: extra: unknown key"),
    ("typo-defaults", "cluster: demo\ndefault: {}\n" + OK_HOSTS, "2:1: default: unknown key (did you mean 'defaults'?)"),
    ("typo-host-key", host("{host: b, wokers: 1}"), "4:15: hosts[1].wokers: unknown key (did you mean 'workers'?)"),
    ("typo-restart-key", host("{host: b, restart_limt: 3}"), "4:15: hosts[1].restart_limt: unknown key (did you mean 'restart_limit'?)"),
    ("ps-in-defaults", "cluster: demo\ndefaults:\n  ps: 1\n" + OK_HOSTS,
     "3:3: defaults.ps: not allowed in defaults: set it in each hosts entry"),
    ("merge-key", host("{host: b, <<: {workers: 1}}"), "4:15: hosts[1]: YAML merge keys (<<) are not supported; use defaults"),
    ("duplicate-key", host("{host: b, workers: 1, host: c}"), "4:27: hosts[1].host: duplicate key (first given at line 4)"),
    ("key-with-shell-chars", host("{host: b, '$(reboot)': 1}"), "4:15: hosts[1].'$(reboot)': unknown key"),
    ("number-as-key", host("{host: b, 22: port}"), "4:15: hosts[1]: expected a key name, got 22"),
    # -- duplicate ports
    ("duplicate-explicit-port", host("{host: b, workers: [2300, 2300]}"),
     "4:31: hosts[1].workers[1]: port 2300 on host 'b' is already used by hosts[1].workers[0] (line 4)"),
    ("duplicate-counted-port", host("{host: GPU-01, workers: 1}"),
     "4:20: hosts[1].workers: port 2222 on host 'GPU-01' is already used by hosts[0].ps (line 3)"),
    ("duplicate-local-port", "cluster: demo\ndefaults: {connection: local}\nhosts:\n  - {host: localhost, ps: 1}\n"
     "  - {host: 127.0.0.1, workers: 1}\n",
     "5:23: hosts[1].workers: port 2222 on the local machine is already used by hosts[0].ps (line 4)"),
    # -- huge numbers
    ("workers-30-digits", host("{host: b, workers: 100000000000000000000000000000}"),
     "4:15: hosts[1].workers: expected at most 1000 tasks per host, got a 30-digit number"),
    ("workers-5000-digits", host(f"{{host: b, workers: {'9' * 5000}}}"),
     "4:15: hosts[1].workers: expected at most 1000 tasks per host, got a 5000-digit number"),
    ("workers-inf", host("{host: b, workers: 1.0e+400}"), f"4:15: hosts[1].workers: {COUNT}, got 1.0e+400"),
    ("port-23-digits", host("{host: b, port: 12345678901234567890123}"), f"4:15: hosts[1].port: {PORT}, got a 23-digit number"),
    ("port-65536", host("{host: b, port: 65536}"), f"4:15: hosts[1].port: {PORT}, got 65536"),
    ("ports-past-65535", host("{host: b, tf_port: 65535, workers: 2}"),
     "4:31: hosts[1].workers: expected ports 1..65535, but counting up from tf_port 65535 reaches 65536"),
    ("too-many-tasks", host("{host: b, ps: 600, workers: 600}"), "4:24: hosts[1].workers: expected at most 1000 tasks per host, got 1200"),
    ("cluster-name-too-long", f"cluster: {'a' * 64}\n" + OK_HOSTS, f"1:1: cluster: {NAME}, got '{'a' * 40}...'"),
    # -- host names, users, addresses and cluster names with spaces, quotes and shell characters
    ("host-space", host("{host: 'gpu 02', workers: 1}"), "4:6: hosts[1].host: expected a host name without whitespace, got 'gpu 02'"),
    ("host-semicolon", host("{host: 'gpu-02; rm -rf ~', workers: 1}"), f"4:6: hosts[1].host: expected a host name {SHELL}, got 'gpu-02; rm -rf ~'"),
    ("host-command-substitution", host("{host: '$(touch pwned)', workers: 1}"),
     f"4:6: hosts[1].host: expected a host name {SHELL}, got '$(touch pwned)'"),
    ("host-backticks", host("{host: '`id`', workers: 1}"), f"4:6: hosts[1].host: expected a host name {SHELL}, got '`id`'"),
    ("host-single-quote", host("{host: \"o'brien\", workers: 1}"), f"4:6: hosts[1].host: expected a host name {SHELL}, got \"o'brien\""),
    ("host-double-quote", host("{host: 'a\"b', workers: 1}"), f"4:6: hosts[1].host: expected a host name {SHELL}, got 'a\"b'"),
    ("host-newline", host("{host: \"gpu-02\\nrm -rf ~\", workers: 1}"),
     "4:6: hosts[1].host: expected a host name without control characters or newlines, got 'gpu-02\\nrm -rf ~'"),
    ("host-block-scalar-newline", "cluster: demo\nhosts:\n  - host: |\n      gpu-01\n      reboot\n    ps: 1\n    workers: 1\n",
     "3:5: hosts[0].host: expected a host name without control characters or newlines, got 'gpu-01\\nreboot\\n'"),
    ("host-bidi-override", host("{host: \"gpu\\u202e10-\", workers: 1}"),
     "4:6: hosts[1].host: expected a host name without control characters or newlines, got 'gpu\\u202e10-'"),
    ("host-ssh-option", host("{host: -oProxyCommand=touch, workers: 1}"),
     "4:6: hosts[1].host: expected a host name not starting with '-', got '-oProxyCommand=touch'"),
    ("host-user-at", host("{host: root@gpu-02, workers: 1}"),
     "4:6: hosts[1].host: expected a host name without '@' (set the login name with user:), got 'root@gpu-02'"),
    ("host-colon-port", host("{host: 'gpu-02:2200', workers: 1}"),
     "4:6: hosts[1].host: expected a host name without ':PORT' (set the SSH port with port:), got 'gpu-02:2200'"),
    ("user-semicolon", host("{host: b, user: 'bob;id', workers: 1}"), f"4:15: hosts[1].user: expected a user name {SHELL}, got 'bob;id'"),
    ("address-substitution", host("{host: b, address: '$(curl evil)', workers: 1}"),
     f"4:15: hosts[1].address: expected an address {SHELL}, got '$(curl evil)'"),
    ("address-with-port", host("{host: b, address: '10.0.0.2:2222', workers: 1}"),
     "4:15: hosts[1].address: expected an address without ':PORT' (TF ports come from ps, workers and tf_port), got '10.0.0.2:2222'"),
    ("cluster-space", "cluster: my cluster\n" + OK_HOSTS, f"1:1: cluster: {NAME}, got 'my cluster'"),
    ("cluster-shell", "cluster: 'demo;$(id)'\n" + OK_HOSTS, f"1:1: cluster: {NAME}, got 'demo;$(id)'"),
    ("cluster-path-traversal", "cluster: ../../etc\n" + OK_HOSTS, f"1:1: cluster: {NAME}, got '../../etc'"),
    # -- paths: spaces, quotes and shell characters are fine, newlines and NUL are not
    ("workdir-newline", host("{host: b, workdir: \"~/dtf\\n$(reboot)\", workers: 1}"),
     "4:15: hosts[1].workdir: expected a path without newlines or NUL characters, got '~/dtf\\n$(reboot)'"),
    ("workdir-block-scalar", "cluster: demo\nhosts:\n  - host: gpu-01\n    ps: 1\n    workers: 1\n    workdir: |\n      /tmp/a\n      touch pwned\n",
     "6:5: hosts[0].workdir: expected a path without newlines or NUL characters, got '/tmp/a\\ntouch pwned\\n'"),
    ("python-nul", host("{host: b, python: \"/usr/bin/python3\\0 -c 'import os'\", workers: 1}"),
     "4:15: hosts[1].python: expected a path without newlines or NUL characters, got \"/usr/bin/python3\\x00 -c 'import os'\""),
    ("identity-file-cr", host("{host: b, identity_file: \"~/.ssh/id\\r\", workers: 1}"),
     "4:15: hosts[1].identity_file: expected a path without newlines or NUL characters, got '~/.ssh/id\\r'"),
    ("ssh-config-newline", "cluster: demo\nssh_config: \"~/.ssh/config\\nHost *\"\n" + OK_HOSTS,
     "2:1: ssh_config: expected a path without newlines or NUL characters, got '~/.ssh/config\\nHost *'"),
    ("workdir-empty", host("{host: b, workdir: '', workers: 1}"), "4:15: hosts[1].workdir: expected a path, got an empty string"),
    # -- restart_limit and restart_backoff
    ("restart-limit-bool", host("{host: b, restart_limit: true, workers: 1}"), f"4:15: hosts[1].restart_limit: {LIMIT}, got a boolean (true)"),
    ("restart-limit-negative", host("{host: b, restart_limit: -1, workers: 1}"), f"4:15: hosts[1].restart_limit: {LIMIT}, got -1"),
    ("restart-limit-float", host("{host: b, restart_limit: 2.5, workers: 1}"), f"4:15: hosts[1].restart_limit: {LIMIT}, got 2.5"),
    ("restart-limit-huge", "cluster: demo\ndefaults:\n  restart_limit: 1000001\n" + OK_HOSTS,
     f"3:3: defaults.restart_limit: {LIMIT}, got 1000001"),
    ("restart-limit-60-digits", host(f"{{host: b, restart_limit: {'1' * 60}, workers: 1}}"),
     f"4:15: hosts[1].restart_limit: {LIMIT}, got a 60-digit number"),
    ("restart-limit-null", host("{host: b, restart_limit: null, workers: 1}"), f"4:15: hosts[1].restart_limit: {LIMIT}, got null"),
    ("restart-backoff-nan", host("{host: b, restart_backoff: .nan, workers: 1}"), f"4:15: hosts[1].restart_backoff: {BACKOFF}, got .nan"),
    ("restart-backoff-inf", "cluster: demo\ndefaults: {restart_backoff: .inf}\n" + OK_HOSTS,
     f"2:12: defaults.restart_backoff: {BACKOFF}, got .inf"),
    ("restart-backoff-negative", host("{host: b, restart_backoff: -0.5, workers: 1}"), f"4:15: hosts[1].restart_backoff: {BACKOFF}, got -0.5"),
    ("restart-backoff-too-long", host("{host: b, restart_backoff: 3601, workers: 1}"), f"4:15: hosts[1].restart_backoff: {BACKOFF}, got 3601"),
    ("restart-backoff-unit", host("{host: b, restart_backoff: 5s, workers: 1}"), f"4:15: hosts[1].restart_backoff: {BACKOFF}, got '5s'"),
    ("restart-backoff-bool", host("{host: b, restart_backoff: off, workers: 1}"), f"4:15: hosts[1].restart_backoff: {BACKOFF}, got a boolean (off)"),
    ("restart-backoff-shell", host("{host: b, restart_backoff: '$(sleep 9)', workers: 1}"),
     f"4:15: hosts[1].restart_backoff: {BACKOFF}, got '$(sleep 9)'"),
    # -- line endings and BOM do not shift line numbers
    ("crlf", "cluster: demo\r\nhosts:\r\n  - {host: 'a b', ps: 1, workers: 1}\r\n",
     "3:6: hosts[0].host: expected a host name without whitespace, got 'a b'"),
    ("bom", "\ufeffcluster: demo\nhosts:\n  - {host: a, ps: 1, workers: x}\n", f"3:22: hosts[0].workers: {COUNT}, got 'x'"),
]
CATEGORIES = ("invalid YAML", "cannot read file", "unknown key", "missing required key", "already used by",
              "digit number", "without whitespace", "without quotes or shell characters", "without control characters",
              "without newlines", "restart_limit", "restart_backoff", "duplicate key")


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", newline="")  # keep \r and \r\n as written
    return path


def test_corpus_ids_are_unique_and_cover_every_category() -> None:
    assert len({case_id for case_id, _, _ in CORPUS}) == len(CORPUS)
    for needle in CATEGORIES:
        assert any(needle in expected for _, _, expected in CORPUS), needle


@pytest.mark.parametrize(("text", "expected"), [pytest.param(t, e, id=i) for i, t, e in CORPUS])
def test_hostile_inventory_is_one_error_line_exit_3(isolated: Path, text: str | bytes, expected: str) -> None:
    path = write(isolated / "inventory.yaml", text)
    r = runner.invoke(app, ["up", "--dry-run", str(path)])
    output = _ANSI.sub("", r.output)
    assert "Traceback" not in output and "internal error" not in output, output
    assert r.exit_code == 3, output
    assert output.splitlines() == [f"dtf: error: {path}:{expected}"]
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not (isolated / "dtf-home").exists() and not (isolated / "pwned").exists()


SUBPROCESS_CASES = ["tab-indent", "host-command-substitution", "duplicate-explicit-port", "restart-backoff-nan", "not-utf8"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_real_command_exit_code_and_one_stderr_line(isolated: Path, case_id: str) -> None:
    (text, expected), = [(t, e) for i, t, e in CORPUS if i == case_id]
    path = write(isolated / "inventory.yaml", text)
    r = dtf("up", "--dry-run", str(path), home=isolated / "dtf-home", timeout=60, env={"HOME": str(isolated / "home")})
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stdout == ""
    assert _ANSI.sub("", r.stderr).splitlines() == [f"dtf: error: {path}:{expected}"]


# -- valid values with shell characters: accepted, and quoted in the printed commands ----------


def start_command(output: str, host_name: str) -> str:
    """The `start` command the dry run prints for `host_name`."""
    section = output.split(f"\nhost {host_name} (", 1)[1]
    return re.search(r"^  start    (.*)$", section, re.M).group(1)


@pytest.mark.parametrize(
    ("settings_yaml", "python", "workdir", "quoted_python", "quoted_dir"),
    [
        pytest.param('workdir: "~/my dir/$(touch pwned); `touch pwned`"', "python3", "~/my dir/$(touch pwned); `touch pwned`",
                     "python3", "~/'my dir/$(touch pwned); `touch pwned`/demo'", id="workdir-substitution"),
        pytest.param("python: '/opt/it''s \"here\"/bin/python3'", "/opt/it's \"here\"/bin/python3", "~/.dtf",
                     "'/opt/it'\"'\"'s \"here\"/bin/python3'", "~/.dtf/demo", id="python-quotes"),
        pytest.param("workdir: '/srv/a;b|c&&d>e'", "python3", "/srv/a;b|c&&d>e",
                     "python3", "'/srv/a;b|c&&d>e/demo'", id="workdir-operators"),
        pytest.param("workdir: $HOME/dtf", "python3", "$HOME/dtf", "python3", "'$HOME/dtf/demo'", id="workdir-variable"),
        pytest.param("python: '/opt/py*/bin/python?'\nworkdir: '*'", "/opt/py*/bin/python?", "*",
                     "'/opt/py*/bin/python?'", "'*/demo'", id="globs"),
    ],
)
def test_valid_shell_characters_are_quoted_in_the_dry_run(
    isolated: Path, settings_yaml: str, python: str, workdir: str, quoted_python: str, quoted_dir: str
) -> None:
    settings_block = "".join(f"    {line}\n" for line in settings_yaml.splitlines())
    text = f"cluster: demo\nhosts:\n  - host: gpu-01\n    address: 10.0.0.1\n{settings_block}    ps: 1\n    workers: 1\n"
    path = write(isolated / "inventory.yaml", text)
    r = runner.invoke(app, ["up", "--dry-run", str(path)])
    assert r.exit_code == 0, r.output
    command = start_command(_ANSI.sub("", r.output), "gpu-01")
    # quoted_dir + "/launcher-<hash>.pyz", inside the quotes if it has them.
    name = launcher_name()
    launcher = quoted_dir[:-1] + f"/{name}'" if quoted_dir.endswith("'") else quoted_dir + f"/{name}"
    assert command.startswith(f"{quoted_python} -S {launcher} start --dir {quoted_dir} "), command
    # What the remote shell makes of the command is exactly the argv, ~/ aside.
    argv = shlex.split(command)
    assert argv[:6] == [python, "-S", f"{workdir}/demo/{name}", "start", "--dir", f"{workdir}/demo"]
    assert not (isolated / "pwned").exists() and not (isolated / "dtf-home").exists()


def test_local_host_with_hostile_workdir_is_quoted(isolated: Path) -> None:
    text = ("cluster: demo\nhosts:\n  - host: localhost\n    connection: local\n    python: /usr/bin/python3\n"
            "    workdir: \"~/it's $(touch pwned) here\"\n    ps: 1\n    workers: 1\n")
    r = runner.invoke(app, ["up", "--dry-run", str(write(isolated / "inventory.yaml", text))])
    assert r.exit_code == 0, r.output
    command = start_command(r.output, "localhost")
    assert command.startswith(f"/usr/bin/python3 -S ~/'it'\"'\"'s $(touch pwned) here/demo/{launcher_name()}' start "
                              "--dir ~/'it'\"'\"'s $(touch pwned) here/demo' "), command
    assert not (isolated / "pwned").exists()


def test_valid_restart_settings_dry_run(isolated: Path) -> None:
    text = ("cluster: demo\ndefaults: {restart_limit: 0, restart_backoff: 0.25}\nhosts:\n"
            "  - {host: gpu-01, address: 10.0.0.1, ps: 1, workers: 1, restart_limit: 1000000, restart_backoff: 3600}\n")
    r = runner.invoke(app, ["up", "--dry-run", str(write(isolated / "inventory.yaml", text))])
    assert r.exit_code == 0, r.output
    assert "10.0.0.1:2222" in r.output


# -- values that look like rich markup or emoji codes are printed as written -------------------


def test_rich_closing_tag_in_a_value_is_printed_not_parsed(isolated: Path) -> None:
    path = write(isolated / "inventory.yaml", "cluster: '[/x]'\n" + OK_HOSTS)
    r = runner.invoke(app, ["up", "--dry-run", str(path)])
    assert r.exit_code == 3 and r.output.splitlines() == [f"dtf: error: {path}:1:1: cluster: {NAME}, got '[/x]'"]


def test_rich_style_tag_in_a_value_is_printed_not_swallowed(isolated: Path) -> None:
    path = write(isolated / "inventory.yaml", "cluster: '[red]x'\n" + OK_HOSTS)
    r = runner.invoke(app, ["up", "--dry-run", str(path)])
    assert r.output.splitlines() == [f"dtf: error: {path}:1:1: cluster: {NAME}, got '[red]x'"]


def test_emoji_code_in_a_path_is_printed_as_written(isolated: Path) -> None:
    text = "cluster: demo\nhosts:\n  - {host: gpu-01, address: 10.0.0.1, workdir: '/srv/:smile:', ps: 1, workers: 1}\n"
    r = runner.invoke(app, ["up", "--dry-run", str(write(isolated / "inventory.yaml", text))])
    assert r.exit_code == 0 and "--dir /srv/:smile:/demo " in start_command(r.output, "gpu-01")


# -- random YAML: an inventory or one-line errors, never a traceback ---------------------------

_KEYS = ["cluster", "hosts", "defaults", "ssh_config", "host", "ps", "workers", "port", "tf_port", "user",
         "connection", "address", "python", "workdir", "identity_file", "restart_limit", "restart_backoff", "wokers"]
_HOST_KEYS = _KEYS[4:]
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.integers(min_value=0, max_value=3),
    st.integers(min_value=2220, max_value=2226),
    st.floats(allow_nan=True),
    st.floats(min_value=0, max_value=4000),
    st.text(max_size=12),
    st.sampled_from(["local", "ssh", "gpu-01", "localhost", "a b", "$(x)", "-o", "demo", "", "a;b", "~/x y",
                     "u@h", "h:22", "::1", "10.0.0.1", "'", '"', "\n", "`id`"]),
)
_keys = st.one_of(st.sampled_from(_KEYS), st.text(max_size=6))
_structures = st.recursive(
    _leaves,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_keys, children, max_size=5)),
    max_leaves=25,
)
_host = st.dictionaries(st.sampled_from(_HOST_KEYS), st.one_of(_leaves, _structures), max_size=6)
# ssh_config only ever names a file that exists (or is not a path): a missing file is a known
# transport issue (Fabric raises FileNotFoundError), outside what the inventory checks.
_inventories = st.fixed_dictionaries(
    {"cluster": st.one_of(_leaves, st.just("demo")), "hosts": st.lists(_host, max_size=4)},
    optional={"defaults": st.dictionaries(st.sampled_from(_HOST_KEYS[1:]), _leaves, max_size=3),
              "ssh_config": st.sampled_from([None, "/dev/null", 1, [], "", True])},
)
# Mostly valid: a sound skeleton, with hostile but valid values in the settings (paths may hold
# any character but \n, \r and NUL).
_paths = st.one_of(
    st.text(st.characters(blacklist_characters="\n\r\x00", blacklist_categories=("Cs",)), min_size=1, max_size=15),
    st.sampled_from(["~/x y", "~/$(touch pwned)", "`touch pwned`", "a;b", "~", "~/", "/", "-rf", "'", '"', "\\",
                     "%s", "{}", "~user/x", "$HOME", "a'b\"c", "*", "?", ":smile:"]),
)
_near_valid_host = st.fixed_dictionaries(
    {"host": st.sampled_from(["gpu-01", "gpu-02", "localhost", "10.0.0.1", "::1", "fe80::1%eth0", "h.example.com"]),
     "ps": st.integers(0, 2), "workers": st.integers(0, 2)},
    optional={"address": st.sampled_from(["10.0.0.9", "fd00::9", "b"]), "tf_port": st.integers(1, 65533),
              "connection": st.sampled_from(["ssh", "local"]), "python": _paths, "workdir": _paths,
              "identity_file": _paths, "user": st.sampled_from(["ubuntu", "alice@corp", None]),
              "port": st.one_of(st.integers(1, 65535), st.none()),
              "restart_limit": st.integers(0, 1_000_000),
              "restart_backoff": st.one_of(st.floats(0, 3600), st.integers(0, 3600))},
)
_near_valid = st.fixed_dictionaries({"cluster": st.sampled_from(["demo", "c.1"]),
                                     "hosts": st.lists(_near_valid_host, min_size=1, max_size=4)})
_yamlish = st.lists(
    st.one_of(
        st.sampled_from(["cluster: ", "hosts:", "defaults:", "- ", "  ", "{", "}", "[", "]", ":", ",", "\n", "\r",
                         "\t", "&a ", "*a", "!!python/object ", "!!int ", "!!float ", "'", '"', "#", "?", "---",
                         "|", ">", "<<: ", "%YAML 1.1", "\\", "\\n", "$(", ";", "`", "@"]),
        st.sampled_from([f"{k}: " for k in _KEYS]),
        st.text(max_size=5),
    ),
    max_size=30,
).map("".join)


@settings(deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(
    _yamlish,
    st.one_of(_structures, _inventories, _near_valid).map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
))
def test_property_random_yaml_through_the_cli(isolated: Path, text: str) -> None:
    path = isolated / "random.yaml"
    path.write_text(text, encoding="utf-8", newline="")
    r = runner.invoke(app, ["up", "--dry-run", str(path)])
    output = _ANSI.sub("", r.output)
    assert "Traceback" not in output and "internal error" not in output, output
    assert r.exit_code in (0, 3), (r.exit_code, output)
    event(f"exit code {r.exit_code}")
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = output.split("\n")  # not splitlines(): a valid path may hold \x0b, \x85 or \u2028
    if r.exit_code == 3:  # one line per mistake; the first carries the "dtf: error:" prefix
        assert lines[-1] == "" and lines[0].startswith(f"dtf: error: {path}:"), output
        assert all(line.startswith(f"{path}:") for line in lines[1:-1]), output
    else:
        assert lines[0].startswith("cluster "), output
        # Whatever the paths hold, the shell sees python, -S, launcher, "start", "--dir", dir, ...
        starts = [line[len("  start    "):] for line in lines if line.startswith("  start    ")]
        assert starts, output
        for command in starts:
            argv = shlex.split(command)
            assert argv[1] == "-S" and argv[3:5] == ["start", "--dir"], command
