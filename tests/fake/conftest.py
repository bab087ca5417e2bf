"""Fake-server tests run twice: on local processes, and on the SSH lab."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lab import Lab
from sites import LabSite, LocalSite, Site


@pytest.fixture(params=["local", pytest.param("lab", marks=pytest.mark.lab)])
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    """Where the cluster runs: every scenario whose outcome depends on the transport runs on both."""
    if request.param == "local":
        the_site: Site = LocalSite(tmp_path)
    else:
        the_site = LabSite(tmp_path, request.getfixturevalue("lab"))
    try:
        yield the_site
    finally:
        the_site.cleanup()


@pytest.fixture
def local_site(tmp_path: Path) -> Iterator[Site]:
    """Local processes only: for what happens on the laptop alone (dtf's own decisions)."""
    the_site = LocalSite(tmp_path)
    try:
        yield the_site
    finally:
        the_site.cleanup()


@pytest.fixture
def netns_site(tmp_path: Path, lab: Lab) -> Iterator[Site]:
    """The SSH lab only, in network namespaces: for what needs hosts of their own addresses."""
    if lab.mode != "netns":
        pytest.skip("needs network namespaces")
    the_site = LabSite(tmp_path, lab)
    try:
        yield the_site
    finally:
        the_site.cleanup()
