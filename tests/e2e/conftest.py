"""Fixtures of the end-to-end tests on the SSH lab."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import down_recorded, dtf, leftovers, write_local_inventory


@pytest.fixture
def home(tmp_path: Path, lab):
    """A DTF_HOME; after the test, any cluster it recorded is taken down and nothing may be left."""
    home = tmp_path / "home"
    yield home
    down_recorded(home)
    assert leftovers(lab) == {}


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory):
    """One local cluster (1 ps, 2 workers), up for the tests marked LOCAL_CLUSTER: its inventory
    and DTF_HOME."""
    where = tmp_path_factory.mktemp("local-cluster")
    inventory, home = write_local_inventory(where), where / "home"
    r = dtf("up", str(inventory), home=home)
    assert r.returncode == 0, r.stderr
    yield inventory, home
    assert dtf("down", home=home).returncode == 0
