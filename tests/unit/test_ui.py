"""What `dtf up` prints: the started cluster's table, and the live view of its hosts' steps."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from dtf import ui


def test_columns_are_as_wide_as_their_widest_cell_two_spaces_apart():
    text = ui.columns(["task", "host", "pid"], [["ps:0", "a-long-host", "1"], ["worker:10", "h", ""]])
    assert text.splitlines() == [
        "task       host         pid",
        "ps:0       a-long-host  1",
        "worker:10  h",  # (no trailing spaces)
    ]


def _rendered(table: object) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined, no-any-return]


def test_the_live_view_has_a_row_per_host_for_a_few_hosts():
    text = _rendered(ui.progress_table("starting", {"h0": "done", "h1": "connecting"}, 1.25))
    assert "starting" in text and "1.2s" in text
    assert [line.split() for line in text.splitlines() if line.strip().startswith("h") and "step" not in line] == [
        ["h0", "done"], ["h1", "connecting"]]


@pytest.mark.parametrize("hosts", [ui.ROWS_PER_HOST_UP_TO + 1, 100])
def test_the_live_view_of_many_hosts_has_a_row_per_step_trouble_first(hosts: int):
    steps = {f"h{i}": "done" if i % 3 == 0 else "connecting" for i in range(hosts)}
    steps["h7"] = "failed: no route to host"
    text = _rendered(ui.progress_table("starting", steps, 3.0))
    rows = [line.strip() for line in text.splitlines() if line.strip()[:1].isdigit() and "  " in line.strip()]
    assert len(rows) == 3, text  # one per step, not one per host
    done = sum(1 for i in range(hosts) if i % 3 == 0)
    assert rows[0] == "1  failed: no route to host (h7)"
    assert rows[1].startswith(f"{hosts - done - 1}  connecting (h1, h2, h4, h5 and {hosts - done - 5} more)")
    assert rows[2].startswith(f"{done}  done (h0, h3, h6, h9 and {done - 4} more)")


def test_up_prints_its_cluster_as_plain_columns(capsys: pytest.CaptureFixture[str]):
    from types import SimpleNamespace

    tasks = [SimpleNamespace(name="ps:0", host="h0", address="10.0.0.1:2222"),
             SimpleNamespace(name="worker:0", host="h1", address="10.0.0.2:2222")]
    plan = SimpleNamespace(cluster="c", tasks=lambda: tasks,
                           hosts=[SimpleNamespace(name="h0"), SimpleNamespace(name="h1")])
    outcomes = {"h0": SimpleNamespace(seconds=1.04, value=SimpleNamespace(pids={"ps:0": 41}, env=None)),
                "h1": SimpleNamespace(seconds=2.0, value=SimpleNamespace(pids={"worker:0": 42}, env=None))}
    ui.show_up(plan, outcomes, 2.5)  # type: ignore[arg-type]
    assert capsys.readouterr().out.splitlines() == [
        "cluster c is up (2.5s)",
        "task      host  address        pid  host ready in",
        "ps:0      h0    10.0.0.1:2222  41   1.0s",
        "worker:0  h1    10.0.0.2:2222  42   2.0s",
    ]
