"""Shared test setup: `import lab` works, a session-wide SSH lab, and an inventory writer."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import RUN_MARK
from lab import Lab, LabError, lab_mode

# Every process this run starts carries it: helpers.ssh_processes() counts only this run's.
os.environ[RUN_MARK] = f"{os.getpid()}-{os.urandom(4).hex()}"

# The property tests' examples each: `full` unless a run names another profile (`make test` and CI
# run them in full); `make test-fast` runs `fast` (--hypothesis-profile=fast), a quarter of them.
# Tests set their deadline and health checks themselves, not their number of examples.
settings.register_profile("full", max_examples=200)
settings.register_profile("fast", max_examples=50)
settings.load_profile("full")  # (--hypothesis-profile, read after this file, wins)


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Lab]:
    """Three SSH hosts (see tests/lab.py), built once per session."""
    ci = os.environ.get("CI") == "true"
    missing = [why for bad, why in [(os.geteuid() != 0, "not root"),
                                    (not os.access("/usr/sbin/sshd", os.X_OK), "no /usr/sbin/sshd"),
                                    (shutil.which("ssh-keygen") is None, "no ssh-keygen")] if bad]
    if missing:
        reason = "SSH lab unavailable: " + ", ".join(missing)
        if ci:
            pytest.fail(reason + " (CI=true: the lab is required)")
        pytest.skip(reason)
    Lab.cleanup_stale()
    # Under pytest-xdist (`make test`), each worker that runs lab tests has a lab of its own: the
    # first takes DTF_LAB_NAME/DTF_LAB_SUBNET if they are set, the others a free pair.
    pick = os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0"
    try:
        the_lab = Lab(3, root=tmp_path_factory.mktemp("lab"), mode=lab_mode(ci), pick=pick).__enter__()
    except LabError as e:
        pytest.fail(f"SSH lab failed: {e}" + (" (CI=true: network namespaces are required)" if ci else ""))
    try:
        # Labs made later in this run (tests/e2e/test_lab.py) and the run's subprocesses know it.
        os.environ["DTF_LAB_NAME"], os.environ["DTF_LAB_SUBNET"] = the_lab.name, the_lab.subnet
        first, last = the_lab.hosts[0].address, the_lab.hosts[-1].address.rsplit(".", 1)[1]
        where = ("in network namespaces" if the_lab.mode == "netns" else "on loopback (fallback)")
        line = f"lab {the_lab.name}: {len(the_lab.hosts)} hosts {where} {first}-{last}"
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr)
        yield the_lab
    finally:
        the_lab.close()


@pytest.fixture
def write_inventory(lab: Lab, tmp_path: Path) -> Callable[..., Path]:
    """write_inventory([{"host": "h0", "ps": [port]}], **defaults) -> path of a fresh inventory."""
    count = iter(range(1_000_000))

    def write(hosts: list[dict[str, Any]], cluster: str = "lab", **defaults: Any) -> Path:
        return lab.inventory(tmp_path / f"inventory{next(count)}.yaml", hosts, cluster, **defaults)

    return write


# The order the tests are handed out in (`make test` runs them on several pytest-xdist workers,
# each taking the next test, or the next group, as it finishes one): the longest first, so that
# none of them starts last and runs alone on an otherwise idle machine. Classes by marker, the
# order within each as collected (pytest sorts stably).
_FIRST = ("slow", "tf", "slurm", "lab")


@pytest.hookimpl(trylast=True)  # after tests/slurm/conftest.py has marked its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, mark in enumerate(_FIRST) if item.get_closest_marker(mark)), len(_FIRST))

    items.sort(key=rank)


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """`--dist loadgroup` hands a group's tests to one worker by a suffix pytest-xdist adds to their
    ids (`...@slurm`). Under pytest 9.2 the suffix no longer takes (pytest-xdist#1386): nothing
    fails, the groups are spread, and every worker builds a Slurm lab and a local cluster of its
    own (a much longer run; six Slurm labs at once where two runs share a machine). The
    tests in tests/slurm are always one group: refuse to run when they are not."""
    if node.config.getoption("dist") == "loadgroup":
        lost = [i for i in ids if i.startswith("tests/slurm/") and "@" not in i]
        if lost:
            raise pytest.UsageError(f"--dist loadgroup: pytest-xdist did not group {len(lost)} tests "
                                    f"(e.g. {lost[0]}) under pytest {pytest.__version__}: "
                                    f"pytest-xdist#1386 (pyproject pins pytest below 9.2)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test's report shows the tracebacks of dtf's internal errors: the CLI prints one
    line and writes the traceback to $DTF_HOME/debug.log, which lives in the test's tmp_path (a CI
    run keeps nothing else)."""
    report = yield
    if report.failed:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if isinstance(tmp, Path):
            for log in sorted(tmp.rglob("debug.log"))[:3]:
                with contextlib.suppress(OSError):
                    report.sections.append((f"dtf {log}", log.read_text(errors="replace")[-8000:]))
    return report
