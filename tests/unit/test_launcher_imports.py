"""Every host runs a launcher command for each `up`, `status` and `down`, a python start each: what
those commands import is most of their CPU (dtf_server.jsontext, dtf_server.options). They read
and write JSON as json does and read their command lines as argparse did, without either."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtf.files import shipping
from dtf.hosts.control import _BOOT
from dtf.hosts.netutil import listen_ports
from dtf_server import jsontext, protocol
from dtf_server.options import Parser
from dtf_server.protocol import TaskSpec

VALUES = [
    {"a": 1, "b": [1.5, 2e300, -0.0, 10**30, True, False, None], "c": {"d": [], "e": {}}},
    {"text": "é \u2028 \"quoted\" back\\slash \n\t\x00 \U0001f600", "ünï": "ü"},
    [], {}, "a string", 3, 1.1, None, [{"k": "v"}] * 3,
]


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_jsontext_writes_and_reads_what_json_does(value: object):
    assert jsontext.dumps(value) == json.dumps(value)
    assert jsontext.dumps(value, compact=True) == json.dumps(value, separators=(",", ":"))
    text = json.dumps(value)
    assert jsontext.loads(text) == json.loads(text)
    assert jsontext.loads(f" \n\t{text}\r\n ") == json.loads(text)
    assert jsontext.loads(text.encode()) == json.loads(text)


def test_jsontext_refuses_what_json_refuses():
    for bad in ["", "  ", "{", "[1,]", "1 2", "{'a': 1}", "nul", '{"a": 1} x']:
        with pytest.raises(ValueError):
            jsontext.loads(bad)
    for value in [object(), {"a": {1, 2}}, {(1, 2): 3}]:
        with pytest.raises(TypeError):
            jsontext.dumps(value)
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        jsontext.dumps(loop)
    # Not-a-number and the infinities, as json writes and reads them.
    assert jsontext.dumps([math.inf, -math.inf]) == "[Infinity, -Infinity]"
    assert math.isnan(jsontext.loads("NaN")) and jsontext.loads("[-Infinity]") == [-math.inf]


def _parser() -> Parser:
    p = Parser("launcher", 64, "the commands\n")
    c = p.add_parser("start")
    c.add_argument("--dir", required=True)
    c.add_argument("--port", type=int, action="append", default=[])
    c.add_argument("--timeout", type=float, default=90.0)
    c.add_argument("--fresh", action="store_true")
    c.add_argument("--from", dest="source")
    p.add_parser("status").add_argument("--dir")
    return p


def test_options_reads_a_command_line_as_argparse_did(capsys: pytest.CaptureFixture[str]):
    p = _parser()
    args = p.parse_args(["start", "--dir", "/d", "--port", "1", "--port=2", "--fresh", "--from", "--x=y"])
    assert (args.command, args.dir, args.port, args.timeout, args.fresh, args.source) == (
        "start", "/d", [1, 2], 90.0, True, "--x=y")  # (a value is the next argument, whatever it is)
    args = p.parse_args(["start", "--dir=a=b", "--timeout", "2.5"])
    assert (args.dir, args.port, args.timeout, args.fresh, args.source) == ("a=b", [], 2.5, False, None)
    assert p.parse_args(["start", "--dir", "x"]).port == []  # (a default list is never shared)
    for argv, said in [
        (["start"], "launcher start: error: the following arguments are required: --dir"),
        (["start", "--dir", "d", "--no-such"], "launcher start: error: unrecognized argument: --no-such"),
        (["start", "--dir", "d", "extra"], "launcher start: error: unexpected argument: extra"),
        (["start", "--dir", "d", "--port", "x"], "launcher start: error: --port: invalid int value: 'x'"),
        (["start", "--dir"], "launcher start: error: --dir expects a value"),
        (["start", "--dir", "d", "--fresh=1"], "launcher start: error: --fresh takes no value"),
        (["stop"], "launcher: error: unknown command 'stop' (one of: start, status)"),
        ([], "launcher: error: a command is required"),
    ]:
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 64
        assert capsys.readouterr().err == said + "\n"
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out == "usage: launcher COMMAND [OPTIONS]\n\nthe commands\n"
    with pytest.raises(SystemExit):
        p.parse_args(["start", "-h"])
    assert capsys.readouterr().out == "usage: launcher start --dir DIR --port PORT --timeout TIMEOUT --fresh --from SOURCE\n"


# What the launcher's everyday commands must not import: each was milliseconds of every host's
# command (re with enum, functools and collections: json's and argparse's; gettext and locale:
# argparse's; enum and selectors: socket's and signal's; shutil with fnmatch and re: clean's).
HEAVY = {"re", "enum", "json", "argparse", "gettext", "locale", "socket", "signal", "selectors", "shutil",
         "fnmatch", "typing", "contextlib", "subprocess", "threading", "ctypes", "dataclasses", "hashlib"}


def test_the_launchers_everyday_commands_import_none_of_the_heavy_modules(tmp_path: Path):
    """`up`'s check-start (fake servers forked, the mesh check), `status` and `down`'s `stop
    --clean`, run as `up` runs them (control._BOOT, the launcher's bytes on stdin): what they import
    beside python's own start. Without site (whose .pth files import what they like), and a
    TensorFlow's metadata on PYTHONPATH (the check looks for it: procs.tf_version)."""
    data = shipping.launcher_bytes()
    launcher = tmp_path / shipping.launcher_name()
    root = tmp_path / "cluster"
    (port,) = listen_ports(1)
    task = TaskSpec("worker", 0, port, [sys.executable, str(launcher), "fake", "--job", "worker", "--index", "0",
                                        "--port", str(port), "--ready", str(root / "worker-0" / "ready.json")])

    packages = tmp_path / "packages"
    (packages / "tensorflow-2.99.0.dist-info").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(packages)}

    def run(*args: str) -> tuple[str, set[str]]:
        r = subprocess.run([sys.executable, "-S", "-X", "importtime", "-c", _BOOT, str(len(data)), str(launcher),
                            f"{launcher}.tmp", *args], input=data, capture_output=True, timeout=60, env=env)
        imported = {line.split("|")[-1].strip() for line in r.stderr.decode().splitlines()
                    if line.startswith("import time:")}
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        return r.stdout.decode(), imported

    baseline = run_python(tmp_path)
    out, imported = run("check-start", "--dir", str(root), "--port", str(port), "--timeout", "30", "--ttl", "60",
                        "--task", task.to_arg(), "--reach", f"127.0.0.1:{port}")
    try:
        assert protocol.decode(protocol.CheckReply, out.splitlines()[0]).tensorflow == "2.99.0"
        started = protocol.decode(protocol.StartReply, out)
        assert started.ok and started.unreachable == {}, out
        assert imported - baseline, "no import seen: -X importtime said nothing"
        assert not (imported - baseline) & HEAVY, sorted((imported - baseline) & HEAVY)
        out, imported = run("status", "--dir", str(root), "--task", "worker:0")
        assert protocol.decode(protocol.StatusReply, out).tasks["worker:0"].serving
        assert not (imported - baseline) & HEAVY, sorted((imported - baseline) & HEAVY)
    finally:
        out, imported = run("stop", "--dir", str(root), "--task", "worker:0", "--clean")
    stopped = protocol.decode(protocol.StopReply, out)
    assert stopped.tasks["worker:0"].gone and stopped.cleaned is not None and not root.exists()
    assert not (imported - baseline) & HEAVY, sorted((imported - baseline) & HEAVY)


def run_python(tmp_path: Path) -> set[str]:
    """What python itself imports here to run `-c` without site (its own start)."""
    r = subprocess.run([sys.executable, "-S", "-X", "importtime", "-c", "pass"], capture_output=True, text=True,
                       timeout=60, cwd=os.fspath(tmp_path))
    return {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
