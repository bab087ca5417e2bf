"""dtf.notebook without a cluster: the handle's habits, its messages, `dtf train NOTEBOOK.ipynb`'s
checks, and the CLI without the notebook extra (the real kernel: tests/e2e/test_notebook.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

from dtf.errors import UsageError
from dtf.notebook.connection import (
    ClusterGone,
    ConnectError,
    Connection,
    check_keras_order,
    down_message,
    lost_ps_message,
)
from dtf.notebook.execute import _text, check_notebook, kernel_spec, notebook_install, saved_path
from dtf.notebook.kernel import _Noise
from helpers import REPO, assert_one_line_error

# Python run with the notebook extra's packages made unimportable (as where it is not installed).
WITHOUT_EXTRA = ("import sys\n"
                 "for m in ('nbclient', 'ipykernel', 'nbformat', 'jupyter_client'): sys.modules[m] = None\n")


def handle(cluster: str = "a") -> Connection:
    record = types.SimpleNamespace(cluster=cluster, network="direct", plan=types.SimpleNamespace(tasks=list))
    return Connection(record, ops=None, managed=False, ps_wait=1.0)  # type: ignore[arg-type]


def test_connect_again_same_cluster_is_the_same_handle_another_is_refused():
    c = handle("a")
    assert c.again(None) is c and c.again("a") is c
    with pytest.raises(ConnectError) as e:
        c.again("b")
    assert str(e.value) == ("this process is connected to cluster 'a'; TensorFlow connects a process to one "
                            "cluster: restart the kernel (or the program) to connect to 'b'")
    c.closed = True
    with pytest.raises(ConnectError, match="was closed; TensorFlow cannot attach this process again"):
        c.again(None)
    with pytest.raises(ConnectError, match="restart the kernel to connect again"):
        c.strategy  # noqa: B018
    c.closed, c.gone = False, down_message("a")
    with pytest.raises(ClusterGone, match=r"taken down \(`dtf down`\)"):
        c.coordinator  # noqa: B018


def test_errors_are_one_line_in_a_notebook():
    # IPython shows what `_render_traceback_` returns in place of the traceback.
    assert ConnectError("no cluster")._render_traceback_() == ["dtf: error: no cluster"]
    assert ClusterGone(down_message("lab"))._render_traceback_() == [
        "dtf: error: cluster 'lab' was taken down (`dtf down`) while this process was attached: `dtf up` again, "
        "then restart the kernel and connect"]


def test_the_lost_ps_message_says_what_happened_whether_the_servers_are_back_and_how_to_go_on():
    back = lost_ps_message("lab", ["ps:0 (server killed by SIGKILL)"], [], Path("/out/checkpoints"))
    assert back == ("cluster 'lab': ps:0 (server killed by SIGKILL) lost, and with it the variables it held; the "
                    "servers are serving again. This kernel cannot go on training: restart the kernel and run the "
                    "notebook again, resuming from the last checkpoint in /out/checkpoints (dtf.checkpoint_dir())")
    not_back = lost_ps_message("lab", ["ps:0 (not serving)"], ["ps:0 (h0, 10.0.0.1:2222)"], Path("/c"))
    assert "still not serving: ps:0 (h0, 10.0.0.1:2222) (see `dtf status`)" in not_back


def test_the_watch_ends_the_lease_and_the_tunnel_even_where_a_calls_error_found_dtf_down_first(
        monkeypatch: pytest.MonkeyPatch):
    """`dtf down` seen first by a coordinator call's error (`explain` sets `gone`): the watch's
    next look still closes what the connection holds (the lease, the tunnel) and ends, and
    interrupts nothing (the call has its error already)."""
    from dtf.notebook import connection
    from dtf.program import train

    c = handle("lab")
    closed = threading.Event()
    c.stack.callback(closed.set)
    monkeypatch.setattr(connection, "WATCH_EVERY", 0.01)
    monkeypatch.setattr(train, "taken_down", lambda record: True)
    monkeypatch.setattr(train, "interrupt_main_thread", lambda pid: pytest.fail("a call was interrupted"))
    c.gone, c.calls = down_message("lab"), 1  # as `explain` leaves it, the call not yet returned
    watch = threading.Thread(target=c._watch, daemon=True)
    watch.start()
    watch.join(timeout=30)
    assert not watch.is_alive() and closed.is_set() and c.gone == down_message("lab")


def test_the_summary_in_a_notebook(monkeypatch: pytest.MonkeyPatch):
    c = handle("lab")
    rows = [("ps:0", "h0", "10.0.0.1:2222", "alive"), ("worker:0", "h1", "10.0.0.2:2222", "restarting")]
    monkeypatch.setattr(c, "_rows", lambda: rows)
    assert repr(c) == ("dtf cluster 'lab' (direct network, attached)\n"
                       "  task      host  address        state\n"
                       "  ps:0      h0    10.0.0.1:2222  alive\n"
                       "  worker:0  h1    10.0.0.2:2222  restarting")
    page = c._repr_html_()
    assert page.startswith("<div><b>dtf cluster &#x27;lab&#x27; (direct network, attached)</b><table>")
    assert "<td>worker:0</td><td>h1</td><td>10.0.0.2:2222</td><td>restarting</td>" in page


def test_status_reads_as_the_table_of_every_task(monkeypatch: pytest.MonkeyPatch):
    """`repr(dtf.connect().status())` (and what a notebook shows for it) is `dtf status`'s table,
    naming every task; the value is still a list of TaskState."""
    from dtf.hostops.status import TaskState
    from dtf.notebook.connection import Status
    from dtf_server.protocol import TaskStatus

    def task(name: str, host: str, address: str) -> Any:
        return types.SimpleNamespace(name=name, host=host, address=address)

    alive = TaskStatus(alive=True, phase="running", pid=4242, server_pid=4250, uptime=73.4, serving=True)
    back = TaskStatus(alive=True, phase="restarting", pid=4300, server_pid=None, uptime=None, serving=False,
                      restarts=2, last_exit="killed by SIGKILL")
    states = [TaskState(task("ps:0", "h0", "10.0.0.1:2222"), "alive", None, alive),
              TaskState(task("worker:0", "h1", "10.0.0.2:2222"), "restarting", None, back),
              TaskState(task("worker:1", "h2", "10.0.0.3:2222"), "unknown", "unreachable: no answer", None)]
    c = handle("lab")
    monkeypatch.setattr(c, "ops", object())
    monkeypatch.setattr("dtf.hostops.status.states", lambda ops: states)
    status = c.status()
    assert isinstance(status, Status) and list(status) == states
    assert repr(status) == (
        "cluster 'lab': 1 of 3 tasks alive\n"
        "  task      host  address        pid   state                             uptime  restarts  last exit\n"
        "  ps:0      h0    10.0.0.1:2222  4250  alive                             73s     0         -\n"
        "  worker:0  h1    10.0.0.2:2222  -     restarting                        -       2         killed by SIGKILL\n"
        "  worker:1  h2    10.0.0.3:2222  -     unknown (unreachable: no answer)  -       0         -")
    page = status._repr_html_()
    assert page.startswith("<div><b>cluster &#x27;lab&#x27;: 1 of 3 tasks alive</b><table><thead><tr><th>task</th>")
    assert "<td>worker:0</td><td>h1</td><td>10.0.0.2:2222</td><td>-</td><td>restarting</td>" in page


class KerasLazyLoader(types.ModuleType):
    """TensorFlow's loader of tf.keras (tensorflow/python/util/lazy_loader.py), as far as dtf reads it."""

    def __init__(self, version: str | None = None) -> None:
        super().__init__("keras")
        self._tfll_initialized = version is not None
        self._tfll_keras_version = version


def test_only_a_tf_keras_already_bound_to_keras_3_is_refused(monkeypatch: pytest.MonkeyPatch):
    """TensorFlow imported before dtf, Keras 3 its default: tf.keras picks its Keras at its first use
    (checked with TF 2.21), so connect() goes on while nothing used it, and refuses once it is Keras 3."""
    tf = types.ModuleType("tensorflow")
    monkeypatch.setitem(sys.modules, "tensorflow", tf)
    monkeypatch.setitem(sys.modules, "keras", types.SimpleNamespace(__version__="3.15.1"))
    for unbound in (KerasLazyLoader(), KerasLazyLoader("tf_keras")):
        tf.keras = unbound
        check_keras_order()
    tf.keras = KerasLazyLoader("keras_3")
    with pytest.raises(ConnectError) as e:
        check_keras_order()
    assert str(e.value) == ("tf.keras is already Keras 3 in this process (used before dtf was imported), which has "
                            "no ParameterServerStrategy: import dtf before the first use of tf.keras (in a notebook: "
                            "restart the kernel, then import dtf first)")
    # Loaded: the module in the loader's place (or `from tensorflow.keras import ...`), told by its package.
    keras3, tf_keras = types.ModuleType("keras._tf_keras.keras"), types.ModuleType("tf_keras.api._v2.keras")
    keras3.__file__ = "/site-packages/keras/_tf_keras/keras/__init__.py"
    tf_keras.__file__ = "/site-packages/tf_keras/api/_v2/keras/__init__.py"
    tf.keras, tf.optimizers = tf_keras, keras3
    with pytest.raises(ConnectError, match=r"^tf.optimizers is already Keras 3"):
        check_keras_order()
    tf.keras, tf.optimizers = keras3, keras3
    with pytest.raises(ConnectError, match=r"^tf.keras, tf.optimizers are already Keras 3"):
        check_keras_order()


def test_the_kernel_drops_tensorflows_noise_and_cut_off_closures_only():
    def record(level: int, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("tensorflow", level, "f.py", 1, msg, args, None)

    keep = _Noise().filter
    assert not keep(record(logging.ERROR, " /job:worker/task:%d encountered the following error when processing "
                                          "closure: %r:%s", 1, "UnavailableError()", "failed to connect"))
    assert not keep(record(logging.ERROR, "Start cancelling closures due to error %r: %s", "UnavailableError()", "x"))
    assert not keep(record(logging.WARNING, "5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>."
                                            "tf_function_save at 0x7f> triggered tf.function retracing."))
    # The program's own errors on a worker stay, and so does everything else.
    assert keep(record(logging.ERROR, " /job:worker/task:%d encountered the following error when processing "
                                      "closure: %r:%s", 0, "InvalidArgumentError()", "bad shape"))
    assert keep(record(logging.WARNING, "To use the BackupAndRestore callback, you model must be built"))


def test_dtf_train_notebook_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    check_notebook(nb, [])
    with pytest.raises(UsageError, match="a notebook takes no arguments"):
        check_notebook(nb, ["--epochs", "3"])
    with pytest.raises(UsageError, match="--collective is for Python scripts"):
        check_notebook(nb, [], collective=True)
    bad = tmp_path / "bad.ipynb"
    bad.write_text("print('a script named .ipynb')")
    with pytest.raises(UsageError, match=r"bad.ipynb: not a notebook \(not JSON"):
        check_notebook(bad, [])
    monkeypatch.setitem(sys.modules, "nbclient", None)
    with pytest.raises(UsageError) as e:
        check_notebook(nb, [])
    assert str(e.value) == f"running a notebook needs nbclient, the notebook extra: {notebook_install()}"


def test_the_cli_without_the_notebook_extra(tmp_path: Path):
    env = {**os.environ, "DTF_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO / "client")}
    # Importable, and `dtf.connect` is there (it imports what it needs when called).
    code = WITHOUT_EXTRA + "import dtf, dtf.cli, dtf.notebook, dtf.program.train; print(callable(dtf.connect))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "True"), r.stderr
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    code = WITHOUT_EXTRA + f"sys.argv = ['dtf', 'train', {str(nb)!r}]\nfrom dtf.cli import main\nmain()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert_one_line_error(r, 2, f"running a notebook needs nbclient and ipykernel, the notebook extra: {notebook_install()}")


@pytest.mark.parametrize("prefix, env, clone, expected", [
    # pipx (its default home, and PIPX_HOME), uv tool (its default, and UV_TOOL_DIR), a virtual environment
    ("/home/u/.local/share/pipx/venvs/dtf", {}, ("/home/u/dtf", False), "pipx install --force '/home/u/dtf[notebook]'"),
    ("/opt/px/venvs/dtf", {"PIPX_HOME": "/opt/px"}, ("/src/dtf", False), "pipx install --force '/src/dtf[notebook]'"),
    ("/home/u/.local/share/uv/tools/dtf", {}, ("/home/u/dtf", False), "uv tool install --force '/home/u/dtf[notebook]'"),
    ("/t/dtf", {"UV_TOOL_DIR": "/t"}, (None, False), "uv tool install --force '.[notebook]' (in dtf's clone)"),
    ("/home/u/dtf/.venv", {}, ("/home/u/dtf", True), "PYTHON -m pip install -e '/home/u/dtf[notebook]'"),
    ("/home/u/env", {}, ("/home/u/my dtf", False), "PYTHON -m pip install '/home/u/my dtf[notebook]'"),
])
def test_the_notebook_extra_is_installed_where_dtf_is(prefix: str, env: dict[str, str], clone: tuple[str | None, bool],
                                                       expected: str, monkeypatch: pytest.MonkeyPatch):
    """`pip install 'dtf[notebook]'` went to whatever environment pip is (and to the package index):
    the command names the environment dtf runs in, as the README installs it from a clone."""
    for name in ("PIPX_HOME", "UV_TOOL_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "prefix", prefix)
    monkeypatch.setattr("dtf.notebook.execute.installed_from", lambda: clone)
    assert notebook_install() == expected.replace("PYTHON", sys.executable)


def test_installed_from_reads_where_this_dtf_was_installed_from():
    from dtf.notebook.execute import installed_from

    folder, editable = installed_from()  # `make venv`: pip install -e of this checkout
    assert folder is not None and (Path(folder) / "pyproject.toml").exists() and editable


def test_executed_notebook_path_and_kernel_spec(tmp_path: Path):
    nb = tmp_path / "nb" / "tutorial.ipynb"
    assert saved_path(nb, tmp_path / "out") == tmp_path / "out" / "tutorial.ipynb"
    assert saved_path(nb, tmp_path / "nb") == tmp_path / "nb" / "tutorial.executed.ipynb"  # never over the notebook
    spec = json.loads((kernel_spec(tmp_path) / "dtf" / "kernel.json").read_text())
    assert spec["argv"][:2] == [sys.executable, "-c"] and spec["argv"][3:] == ["dtf.notebook.kernel", "-f",
                                                                              "{connection_file}"]


def test_cell_outputs_as_printed():
    assert _text({"output_type": "stream", "name": "stderr", "text": "warn\n"}) == ("stderr", "warn\n")
    assert _text({"output_type": "execute_result", "data": {"text/plain": "42"}}) == ("stdout", "42\n")
    error = {"output_type": "error", "ename": "ValueError", "evalue": "x",
             "traceback": ["\x1b[0;31mValueError\x1b[0m: x"]}
    assert _text(error) == ("stderr", "ValueError: x\n")
    assert _text({"output_type": "display_data", "data": {"image/png": "..."}}) == ("stdout", "")
