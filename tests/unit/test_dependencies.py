"""dtf installs where laptops are: the project's dependencies resolve, with the same TensorFlow
version, for Linux x86_64 and aarch64 and for macOS arm64 (tensorflow-cpu has no macOS or Linux
aarch64 wheel: the plain tensorflow build is pinned there). uv's resolver with a target
platform; nothing is installed. Needs the package index (CI has it)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from dtf.files import environment

REPO = Path(__file__).resolve().parents[2]
TF = environment.TF_VERSION


@pytest.mark.parametrize(("platform", "build"), [
    ("x86_64-unknown-linux-gnu", "tensorflow-cpu"),
    ("aarch64-unknown-linux-gnu", "tensorflow"),
    ("aarch64-apple-darwin", "tensorflow"),
])
def test_dependencies_resolve_for_each_laptop_platform(platform: str, build: str, tmp_path: Path):
    r = subprocess.run([environment.uv_binary(), "pip", "compile", str(REPO / "pyproject.toml"), "--quiet",
                        "--no-header", "--no-annotate", "--python-platform", platform, "--python-version", "3.11",
                        "--extra", "test"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL)
    if r.returncode != 0 and os.environ.get("CI") != "true" and re.search(r"Failed to fetch|dns error|error sending request", r.stderr):
        pytest.skip(f"no package index: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    pins = dict(line.split("==", 1) for line in r.stdout.split() if "==" in line)
    assert pins[build] == TF and pins["tf-keras"] == TF and pins["tensorboard"] == TF
    if build == "tensorflow":
        assert "tensorflow-cpu" not in pins
