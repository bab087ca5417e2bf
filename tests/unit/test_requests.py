"""The launcher's command lines, typed (dtf_server.protocol's requests): what the client writes
(`args()`) the launcher reads back the same (`parse()`, its parser built from the same fields),
each command has its function, and a command line it does not understand is one line and exit 64."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from dtf.files import shipping
from dtf_server import commands, protocol
from dtf_server.protocol import (
    REQUESTS,
    CheckStartRequest,
    Firewall,
    Options,
    Request,
    StartRequest,
    StopRequest,
    SyncRequest,
    TaskSpec,
)

CLIENT = Path(__file__).resolve().parents[2] / "client" / "dtf"
SPEC = TaskSpec("worker", 1, 2223, ["/usr/bin/python3", "/r/launcher-0.pyz", "serve", "--job", "worker"])


def example(kind: type[Options], seed: int = 1) -> Any:
    """An instance of `kind` with every field set to a value other than its default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(kind):
        if "group" in f.metadata:
            values[f.name] = example(f.metadata["group"], seed)
            continue
        o: protocol.Option = f.metadata["option"]
        one: Any = {str: f"/abs/{f.name}-{seed}", int: 7 + seed, float: 2.5 + seed, TaskSpec: SPEC,
                    bool: True}[o.kind]
        if o.choices:
            one = o.choices[-1]
        values[f.name] = [one, one] if o.many else one
    return kind(**values)


@pytest.mark.parametrize("kind", REQUESTS, ids=lambda k: k.command)
def test_every_request_reads_back_as_written(kind: type[Request]):
    request = example(kind)
    argv = request.args()
    assert argv[0] == kind.command
    assert protocol.parse(argv) == request
    # And with only what it must say: the rest is the launcher's default.
    required = {f.name: getattr(request, f.name) for f in dataclasses.fields(kind)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert protocol.parse(kind(**required).args()) == kind(**required)


@pytest.mark.parametrize("kind", REQUESTS, ids=lambda k: k.command)
def test_each_fields_option_holds_what_its_type_says(kind: type[Request]):
    def check(cls: type[Options]) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "group" in f.metadata:
                assert hints[f.name] is f.metadata["group"]
                check(f.metadata["group"])
                continue
            o: protocol.Option = f.metadata["option"]
            expected: Any = list[o.kind] if o.many else o.kind  # type: ignore[name-defined]
            if o.default is None:
                expected = expected | None
            assert hints[f.name] == expected, (cls.__name__, f.name)
            if o.default is not protocol.REQUIRED and not o.many and o.kind is not bool:
                assert f.default in (o.default, dataclasses.MISSING), (cls.__name__, f.name)

    check(kind)


def test_every_command_has_its_function_taking_its_request():
    assert set(commands.RUNS) == set(REQUESTS)
    assert len({k.command for k in REQUESTS}) == len(REQUESTS)
    for kind, name in commands.RUNS.items():
        run = commands.command(name)
        (parameter,) = inspect.signature(run).parameters.values()
        assert parameter.annotation == kind.__name__, (name, parameter.annotation)


def test_a_default_is_left_out_and_what_the_client_decides_is_always_said():
    stop = StopRequest(dir="~/.dtf/c", grace=10.0, task=["ps:0"])
    assert stop.args() == ["stop", "--dir", "~/.dtf/c", "--grace", "10", "--task", "ps:0"]
    assert SyncRequest(dir="d", hash="h").args() == ["sync", "--dir", "d", "--hash", "h"]
    assert SyncRequest(dir="d", hash="h", source="10.0.0.1:9", wait=30.0, token="t").args()[5:] == [
        "--from", "10.0.0.1:9", "--token", "t", "--wait", "30"]
    # A float as short as it stays exact.
    start = StartRequest(dir="d", timeout=90.0, ttl=1234567.0, restart_limit=0, restart_backoff=0.25)
    assert start.args()[3:11] == ["--timeout", "90", "--ttl", "1234567.0", "--restart-limit", "0",
                                   "--restart-backoff", "0.25"]
    assert protocol.parse(start.args()).ttl == 1234567.0


def test_the_firewall_options_are_written_in_their_place():
    start = CheckStartRequest(dir="d", timeout=1.0, ttl=2.0, restart_limit=3, restart_backoff=4.0, port=[5],
                              firewall=Firewall(mode="members", ports=[5, 6], allow=["a"], launch_node=True))
    argv = start.args()
    assert argv[argv.index("--firewall"):argv.index("--port")] == [
        "--firewall", "members", "--firewall-port", "5", "--firewall-port", "6", "--allow", "a", "--allow-launch-node"]
    assert protocol.parse(argv) == start
    assert "--firewall" not in StartRequest(dir="d", timeout=1.0, ttl=2.0, restart_limit=3, restart_backoff=4.0).args()


def test_the_launcher_expands_a_leading_tilde_of_its_paths_only():
    home = os.path.expanduser("~")
    check = protocol.parse(["check", "--dir", "~/.dtf/c", "--env", "~/e", "--wheels", "~/w"])
    assert (check.dir, check.env, check.wheels) == (f"{home}/.dtf/c", f"{home}/e", f"{home}/w")  # type: ignore[attr-defined]
    start = protocol.parse(["start", "--dir", "~/c", "--env", "A=~/x", "--allow", "~/y"])
    assert (start.dir, start.env, start.firewall.allow) == (f"{home}/c", ["A=~/x"], ["~/y"])  # type: ignore[attr-defined]
    assert protocol.parse(["fake", "--job", "ps", "--index", "0", "--port", "1", "--ready", "~/r",
                           "--ready-file", "~/f"]) == protocol.FakeRequest(
        job="ps", index=0, port=1, ready=f"{home}/r", ready_file="~/f")


@pytest.mark.parametrize("argv", [
    [], ["nonsense"], ["status"], ["status", "--dir", "d", "--no-such-option"], ["status", "--di", "d"],
    ["stop", "--dir", "d", "--grace", "soon"], ["start", "--dir", "d", "--firewall", "none"],
    ["start", "--dir", "d", "--task", "{}"], ["start", "--dir", "d", "--task", "not json"],
    ["status", "--dir", "d", "extra"],
], ids=repr)
def test_a_command_line_the_launcher_does_not_understand_is_one_line_and_exit_64(argv: list[str], tmp_path: Path):
    launcher = tmp_path / shipping.launcher_name()
    launcher.write_bytes(shipping.launcher_bytes())
    r = subprocess.run([sys.executable, str(launcher), *argv], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (protocol.EXIT_USAGE, "")
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("launcher") and ": error: " in r.stderr, r.stderr


def test_the_client_writes_no_launcher_option_by_hand():
    """Every launcher command line of the client is a request's args(): no string of the client is
    one of the launcher's options, but dtf's own (cli.py: Typer's) and sbatch's (the inventory's)."""
    names: set[str] = set()

    def collect(kind: type[Options]) -> None:
        for f in dataclasses.fields(kind):
            if "group" in f.metadata:
                collect(f.metadata["group"])
            else:
                names.add(f.metadata["option"].name or "--" + f.name.replace("_", "-"))

    for kind in REQUESTS:
        collect(kind)
    others = {CLIENT / "cli.py", CLIENT / "cluster" / "inventory" / "values.py"}
    written = [f"{p.relative_to(CLIENT)}:{n.lineno}: {n.value}"
               for p in sorted(CLIENT.rglob("*.py")) if p not in others
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]
    assert not written
