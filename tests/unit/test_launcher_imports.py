"""Hosts have no dtf installed, and whatever python they have: the launcher (dtf_server, shipped as
one zipapp) imports the standard library only, never dtf nor a third-party package. What its
commands cost a host is measured by bench/host_cpu.py, against a budget."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from dtf.files import shipping
from dtf.hosts.control import _BOOT
from dtf.hosts.netutil import listen_ports
from dtf_server import protocol
from dtf_server.protocol import TaskSpec

SERVER = Path(__file__).resolve().parents[2] / "server"


def outside_the_standard_library(modules: set[str]) -> set[str]:
    """The top-level packages of `modules` that are neither the standard library nor dtf_server
    (one that exists nowhere is a failed optional import, as copy's of Jython's `org`)."""
    top = {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"dtf_server", "__main__"}
    return {name for name in top if importlib.util.find_spec(name) is not None}


def test_every_launcher_module_imports_the_standard_library_only():
    """Each module of dtf_server in a bare python (no site, only server/ on its path): what it
    imports (TensorFlow's only where tfserve serves, which this does not run)."""
    names = sorted(p.stem for p in (SERVER / "dtf_server").glob("*.py") if p.stem != "__main__")
    code = ("import importlib, sys; [importlib.import_module('dtf_server.' + n) for n in sys.argv[1:]]; "
            "print(' '.join(sys.modules))")
    r = subprocess.run([sys.executable, "-S", "-c", code, *names], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(SERVER), "PATH": os.environ.get("PATH", "")})
    assert r.returncode == 0, r.stderr
    assert not outside_the_standard_library(set(r.stdout.split())), r.stdout


def test_the_launchers_everyday_commands_import_the_standard_library_only(tmp_path: Path):
    """`up`'s check-start (fake servers forked, the mesh check), `status` and `down`'s `stop
    --clean`, run as `up` runs them (control._BOOT, the launcher's bytes on stdin): what they import.
    Without site (whose .pth files import what they like), and a TensorFlow's metadata on
    PYTHONPATH (the check looks for it: protocol.tf_version)."""
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
                    if line.startswith("import time:") and "imported package" not in line}
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        return r.stdout.decode(), imported

    out, imported = run("check-start", "--dir", str(root), "--port", str(port), "--timeout", "30", "--ttl", "60",
                        "--task", task.to_arg(), "--reach", f"127.0.0.1:{port}")
    try:
        assert protocol.decode(protocol.CheckReply, out.splitlines()[0]).tensorflow == "2.99.0"
        started = protocol.decode(protocol.StartReply, out)
        assert started.ok and started.unreachable == {}, out
        assert "dtf_server.commands" in imported, "no import seen: -X importtime said nothing"
        assert not outside_the_standard_library(imported), sorted(imported)
        out, imported = run("status", "--dir", str(root), "--task", "worker:0")
        assert protocol.decode(protocol.StatusReply, out).tasks["worker:0"].serving
        assert not outside_the_standard_library(imported), sorted(imported)
    finally:
        out, imported = run("stop", "--dir", str(root), "--task", "worker:0", "--clean")
    stopped = protocol.decode(protocol.StopReply, out)
    assert stopped.tasks["worker:0"].gone and stopped.cleaned is not None and not root.exists()
    assert not outside_the_standard_library(imported), sorted(imported)
