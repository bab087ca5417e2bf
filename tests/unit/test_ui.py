"""What `dtf up` prints: the started cluster's table, and the live view of its hosts' steps."""

from __future__ import annotations

import contextlib
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
    # pid: the server's (server_pids), not the supervisor's (pids), as in `dtf status`.
    outcomes = {"h0": SimpleNamespace(seconds=1.04, value=SimpleNamespace(pids={"ps:0": 31}, server_pids={"ps:0": 41},
                                                                          env=None)),
                "h1": SimpleNamespace(seconds=2.0, value=SimpleNamespace(pids={"worker:0": 32},
                                                                         server_pids={"worker:0": 42}, env=None))}
    ui.show_up(plan, outcomes, 2.5)  # type: ignore[arg-type]
    assert capsys.readouterr().out.splitlines() == [
        "cluster c is up (2.5s)",
        "task      host  address        pid  host ready in",
        "ps:0      h0    10.0.0.1:2222  41   1.0s",
        "worker:0  h1    10.0.0.2:2222  42   2.0s",
    ]


@pytest.mark.parametrize("failing", [False, True])
def test_on_a_terminal_the_live_view_goes_once_every_host_is_done_and_stays_on_a_failure(
        failing: bool, monkeypatch: pytest.MonkeyPatch):
    """Left on screen, the finished view (its title, each host `done`, its time) stood above `up`'s
    own table and repeated it; a failed step stays, for the error lines below it."""
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    monkeypatch.setattr(ui, "console", lambda stderr=False: terminal)
    with (pytest.raises(RuntimeError) if failing else contextlib.nullcontext(),
          ui.host_progress(["h0", "h1"], "dtf up lab") as step):
        step("h0", "connecting")
        step("h0", "done")
        step("h1", "failed: boom" if failing else "done")
        if failing:
            raise RuntimeError("h1 failed")
    shown = terminal.file.getvalue()  # type: ignore[attr-defined]
    erased = shown.endswith("\x1b[1A\x1b[2K")  # rich's Live, transient: the cursor back up, each line cleared
    assert erased is not failing, repr(shown[-120:])
    assert "dtf up lab" in shown


def test_in_a_pipe_each_step_is_a_line_written_before_what_follows(capsys: pytest.CaptureFixture[str]):
    with ui.host_progress(["h0"], "dtf up lab") as step:
        step("h0", "connecting")
        step("h0", "connecting")  # said again: one line
        step("h0", "done")
    ui.say("cluster lab is up (0.1s)")
    out, err = capsys.readouterr()
    assert (err, out) == ("  h0: connecting\n  h0: done\n", "cluster lab is up (0.1s)\n")
