"""Fixtures of the end-to-end tests on the SSH lab."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import dtf, leftovers


@pytest.fixture
def home(tmp_path: Path, lab):
    """A DTF_HOME; after the test, any cluster it recorded is taken down and nothing may be left."""
    home = tmp_path / "home"
    yield home
    for record in (home / "state").glob("*.json") if (home / "state").is_dir() else []:
        dtf("down", "-c", record.stem, home=home, timeout=120)
    assert leftovers(lab) == {}
