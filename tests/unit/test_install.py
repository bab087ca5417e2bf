"""The user's install (README, Install): `pipx install .`, `uv tool install .` or `pip install .`
put a `dtf` command on PATH with what dtf needs, and nothing of the test tools, which are the
`test` extra. The wheel is built from a copy of the sources (pip, setuptools: no package index)
and installed without its dependencies (this environment has them) into a prefix of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_a_dtf_command_with_the_test_tools_in_an_extra(tmp_path: Path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for tree in ("client", "server"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    [wheel] = (tmp_path / "dist").glob("dtf-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    sources = {str(p.relative_to(REPO / tree)) for tree in ("client", "server") for p in (REPO / tree).rglob("*")
               if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
               and ".egg-info" not in str(p)}
    assert sources - names == set()  # every module and script of dtf and dtf_server ships
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    tools = ("pytest", "mypy", "ruff", "hypothesis", "shellcheck")
    assert [r for r in requires if r.startswith(tools) and 'extra == "test"' not in r] == []
    assert [r for r in requires if r.startswith(tools)] != []  # in the extra
    prefix = tmp_path / "prefix"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--prefix",
                        str(prefix), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    command = prefix / "bin" / "dtf"
    [site] = prefix.glob("lib/python*/site-packages")
    env = {**os.environ, "PYTHONPATH": str(site), "DTF_HOME": str(tmp_path / "home")}  # the copy, not the checkout
    r = subprocess.run([str(command), "up", "--dry-run", str(REPO / "inventory" / "local.yaml")],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "ps:0" in r.stdout, r.stderr
    where = subprocess.run([sys.executable, "-c", "import dtf, dtf_server; print(dtf.__file__, dtf_server.__file__)"],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert where.stdout.split() and all(p.startswith(str(site)) for p in where.stdout.split()), where
