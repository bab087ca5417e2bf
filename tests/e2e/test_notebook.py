"""Training from a notebook (issue 37), with a real Jupyter kernel (jupyter_client running ipykernel,
the stock `python3` kernel a user has) on the SSH lab: `dtf.connect()` in the kernel, TensorFlow's
PSS tutorial's structure (examples/notebook.ipynb) in direct and ssh network modes, its files on
the laptop and none on the hosts; the connect cell run twice; another cluster refused; a worker
killed during a cell; a lost ps and `dtf down` during a cell, each one clear error; `close()`;
`dtf train NOTEBOOK.ipynb`.

The direct-mode tests share one cluster (this module's xdist group); `dtf down` takes it down last.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel

from dtf.program import figures
from helpers import EXAMPLES, NOISE, Train, down_recorded, dtf, status_json, wait_gone, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.slow, pytest.mark.xdist_group("notebook")]

EXAMPLE = EXAMPLES / "notebook.ipynb"
CLUSTER = "nb"
DTF_FILES = {"log", "pid.json", "ready.json", "supervisor.json", "lease.json"}
# A cell that trains until the file STOP exists (after writing STARTED): a fault lands mid-cell.
LOOP = """
import pathlib
import tensorflow as tf
strategy, coordinator = cluster.strategy, cluster.coordinator
with strategy.scope():
    w = tf.Variable(0.0)
@tf.function
def step():
    w.assign_add(1.0)
    return w.read_value()
pathlib.Path("{started}").write_text("")
closures = 0
while not pathlib.Path("{stop}").exists() and closures < 200000:
    for _ in range(20):
        coordinator.schedule(step)
    coordinator.join()
    closures += 20
for _ in range(40):
    coordinator.schedule(step)
coordinator.join()
print("loop done", closures + 40, "steps, w =", float(w.numpy()))
"""


class Kernel:
    """A Jupyter kernel (ipykernel's python3, as a user's notebook has) in `cwd`, with DTF_HOME."""

    def __init__(self, home: Path, cwd: Path, env: dict[str, str] | None = None) -> None:
        # Not pytest's PYTEST_CURRENT_TEST: with it ipykernel leaves fd 1 and 2 alone (iostream.py),
        # and what TensorFlow's C++ side writes there would not reach the cells as in Jupyter.
        env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, **(env or {}),
               "DTF_HOME": str(home)}
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(cwd), startup_timeout=120)
        self.outputs: list[str] = []

    def start(self, code: str) -> str:
        return str(self.kc.execute(code))

    def finish(self, msg_id: str, timeout: float = 900) -> tuple[str, str, list[str]]:
        """(status, text of the outputs, the error's traceback lines) of the cell `msg_id`."""
        out: list[str] = []
        error: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, f"no end of the cell within {timeout:g}s: {''.join(out)[-3000:]}"
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in content["traceback"]]
                out.append("\n".join(error) + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=60)
        text = "".join(out)
        self.outputs.append(text)
        return reply["content"]["status"], text, error

    def run(self, code: str, timeout: float = 900) -> tuple[str, str, list[str]]:
        return self.finish(self.start(code), timeout)

    def ok(self, code: str, timeout: float = 900) -> str:
        status, text, _ = self.run(code, timeout)
        assert status == "ok", text[-5000:]
        return text

    def error(self, code: str, timeout: float = 900) -> list[str]:
        status, text, error = self.run(code, timeout)
        assert status == "error", text[-3000:]
        return error

    def restart(self) -> None:
        """Jupyter's "Restart kernel": a new kernel process, the same client."""
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=120)

    def pid(self) -> int:
        return int(self.ok("import os\nprint(os.getpid())"))

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@contextlib.contextmanager
def kernel(home: Path, cwd: Path, env: dict[str, str] | None = None) -> Iterator[Kernel]:
    k = Kernel(home, cwd, env)
    try:
        yield k
    finally:
        k.close()


def code_cells(path: Path, **params: Any) -> list[str]:
    """The notebook's code cells, with `NAME = value` parameter lines replaced by `params`."""
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for name, value in params.items():
        cells = [re.sub(rf"^{name} = .*$", f"{name} = {value!r}", c, flags=re.M) for c in cells]
    return cells


def task_row(home: Path, task: str) -> dict:
    return next(r for r in status_json(home)["tasks"] if r["task"] == task)


def kill_server(home: Path, task: str) -> int:
    pid = task_row(home, task)["server_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_gone([pid])
    return pid


def serving_again(home: Path, task: str, killed: int) -> None:
    wait_until(lambda: (lambda r: r["state"] == "alive" and r["server_pid"] not in (None, killed))(
        task_row(home, task)), timeout=120, every=1.0)


def dtf_threads(k: Kernel) -> list[str]:
    text = k.ok("import threading\nprint(sorted({t.name for t in threading.enumerate() if t.name.startswith('dtf-')}))")
    return list(json.loads(text.strip().replace("'", '"')))


def kernels_left() -> list[str]:
    """dtf's notebook kernels still running on this machine (of `dtf train NOTEBOOK`)."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if "dtf.notebook.kernel" in argv and os.environ.get("DTF_TEST_RUN", "") in \
                    Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
                found.append(pid)
    return found


def assert_on_laptop_only(lab, laptop: Path, output: Path) -> None:
    """The tutorial's files are under `output` on the laptop; nothing of them on any host."""
    s = json.loads((output / "summary.json").read_text())
    assert s["fit_loss"][-1] < s["fit_loss"][0], s
    saved = {str(p.relative_to(output)) for p in output.rglob("*") if p.is_file()}
    for expected in ["loop_model/saved_model.pb", "loop_model/variables/variables.index",  # model.save
                     "ckpt/saved_model.pb"]:  # ModelCheckpoint
        assert expected in saved, sorted(saved)
    assert any(p.startswith("log/train/events.out.tfevents.") for p in saved), sorted(saved)  # TensorBoard
    for h in lab.hosts:
        assert not lab.exists(h, laptop), h.name
        on_host = [str(p) for p in Path(h.workdir).rglob("*") if p.is_file() and p.name not in DTF_FILES
                   and not p.name.startswith("dtf-") and ".cache" not in p.parts]
        assert not [p for p in on_host if "ckpt" in p or "saved_model" in p or "tfevents" in p], on_host


@pytest.fixture(scope="module")
def direct(lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's cluster (direct network: 1 ps, 2 workers on three hosts): its DTF_HOME."""
    where = tmp_path_factory.mktemp("notebook")
    ps, w0, w1 = lab.ports(3)
    inv = lab.inventory(where / "inventory.yaml", [{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                                                   {"host": "h2", "workers": [w1]}], cluster=CLUSTER)
    home = where / "home"
    r = dtf("up", str(inv), "--network", "direct", home=home, timeout=300)
    assert r.returncode == 0, r.stderr
    yield home
    down_recorded(home)


def test_the_tutorial_notebook_in_a_kernel_direct(direct, lab):
    laptop = lab.laptop_dir("nb-direct")
    cells = code_cells(EXAMPLE, EPOCHS=2, LOOP_EPOCHS=2)
    with kernel(direct, laptop) as k:
        t0 = time.monotonic()
        shown = k.ok(cells[0])
        print(f"connect cell (TensorFlow's import included): {time.monotonic() - t0:.1f}s")
        assert f"dtf cluster '{CLUSTER}' (direct network, attached)" in shown, shown
        for task in ("ps:0", "worker:0", "worker:1"):
            assert re.search(rf"^  {task} .* alive$", shown, re.M), shown
        first = k.ok("print(id(cluster))")
        again = k.ok(cells[0])  # the connect cell run again: the same handle, no new connection
        assert k.ok("print(id(cluster))") == first and "attached" in again
        assert dtf_threads(k) == ["dtf-lease", "dtf-stderr", "dtf-watch"]  # the lease kept while attached
        refused = k.error("dtf.connect('another')")
        assert refused == [f"dtf: error: this process is connected to cluster '{CLUSTER}'; TensorFlow connects "
                           f"a process to one cluster: restart the kernel (or the program) to connect to "
                           f"'another'"], refused
        live = figures.live_dir(direct, CLUSTER)  # what `dtf top` shows: this kernel's run, its figures
        assert json.loads((live / figures.RUN).read_text())["pid"] == k.pid()
        for cell in cells[1:-1]:
            k.ok(cell)
        assert json.loads((live / figures.TRAIN).read_text())["steps"] > 0
        assert k.ok("print(len(cluster.logs('ps:0', n=5).splitlines()) > 0)").strip() == "True"
        k.ok(cells[-1])  # cluster.close()
        assert dtf_threads(k) == ["dtf-stderr"]  # no lease renewed by this kernel any more
        assert not live.exists()
        closed = k.error("cluster.strategy")
        assert closed == [f"dtf: error: the connection to cluster '{CLUSTER}' was closed: restart the kernel to "
                          f"connect again"], closed
        outputs = "".join(k.outputs)
        k.restart()  # a restarted kernel attaches again to the cluster that still runs
        assert f"dtf cluster '{CLUSTER}' (direct network, attached)" in k.ok(cells[0])
    assert "Finished epoch 1" in outputs and "Evaluation accuracy (on the workers)" in outputs, outputs[-3000:]
    for noise in [*NOISE, "INFO:tensorflow:", "Ignoring error status when releasing", "triggered tf.function retracing"]:
        assert noise not in outputs, (noise, outputs[-3000:])
    assert_on_laptop_only(lab, laptop, laptop / "dtf-output")
    assert {r["task"]: r["state"] for r in status_json(direct)["tasks"]} == \
        {"ps:0": "alive", "worker:0": "alive", "worker:1": "alive"}  # close() left the cluster up


def test_a_worker_killed_during_a_cell_costs_only_time(direct, lab):
    laptop = lab.laptop_dir("nb-worker")
    with kernel(direct, laptop) as k:
        k.ok("import dtf\ncluster = dtf.connect()")
        cell = k.start(LOOP.format(started=laptop / "started", stop=laptop / "stop"))
        wait_until(lambda: (laptop / "started").exists(), timeout=300)
        killed = kill_server(direct, "worker:1")
        serving_again(direct, "worker:1", killed)
        (laptop / "stop").write_text("")
        status, text, _ = k.finish(cell, timeout=600)
        assert status == "ok", text[-3000:]
        assert len(text.strip().splitlines()) == 1, text[-3000:]  # what the cell shows: its own line, no error
        closures = int(re.search(r"^loop done (\d+) steps", text, re.M).group(1))
        w = float(re.search(r"w = ([\d.]+)", text).group(1))
        assert w >= closures, text  # every scheduled step ran (at least once: a lost worker's is retried)
        # The next cell trains too.
        assert k.ok("coordinator.schedule(step); coordinator.join(); print('after', float(w.numpy()))").startswith(
            "after")


def test_a_lost_ps_ends_the_cell_with_one_clear_error(direct, lab):
    laptop = lab.laptop_dir("nb-ps")
    with kernel(direct, laptop) as k:
        k.ok("import dtf\ncluster = dtf.connect()")
        cell = k.start(LOOP.format(started=laptop / "started", stop=laptop / "stop"))
        wait_until(lambda: (laptop / "started").exists(), timeout=300)
        killed = kill_server(direct, "ps:0")
        t0 = time.monotonic()
        status, text, error = k.finish(cell, timeout=600)
        print(f"ps:0 killed -> the cell's error {time.monotonic() - t0:.1f}s later")
        assert status == "error", text[-3000:]
        checkpoints = laptop / "dtf-output" / "checkpoints"
        assert error == [f"dtf: error: cluster '{CLUSTER}': ps:0 (server killed by SIGKILL) lost, and with it the "
                         f"variables it held; the servers are serving again. This kernel cannot go on training: "
                         f"restart the kernel and run the notebook again, resuming from the last checkpoint in "
                         f"{checkpoints} (dtf.checkpoint_dir())"], text[-3000:]
        assert k.error("cluster.coordinator")[0].startswith(f"dtf: error: cluster '{CLUSTER}': ps:0 (")
    serving_again(direct, "ps:0", killed)


def test_a_dropped_network_ends_the_cell_in_one_line_and_the_next_cell_trains(direct, lab):
    """This machine cut off from the hosts during a cell (a Wi-Fi drop): the cell ends with one line
    saying the cluster is intact (or goes on), and the next cell trains without connecting again.
    The kernel's gRPC keepalive is short (its own environment's TF_GRPC_DEFAULT_OPTIONS), so that
    the cut connections are found dead within seconds, as within a minute with dtf's defaults."""
    laptop = lab.laptop_dir("nb-network")
    keepalive = {"TF_GRPC_DEFAULT_OPTIONS": "grpc.keepalive_time_ms=1000,grpc.keepalive_timeout_ms=2000"}
    with kernel(direct, laptop, keepalive) as k:
        k.ok("import dtf\ncluster = dtf.connect()")
        cell = k.start(LOOP.format(started=laptop / "started", stop=laptop / "stop"))
        wait_until(lambda: (laptop / "started").exists(), timeout=300)
        with lab.laptop_cut():
            time.sleep(15)
        (laptop / "stop").write_text("")
        status, text, error = k.finish(cell, timeout=900)
        if status == "error":
            assert len(error) == 1 and error[0].startswith(
                f"dtf: error: cluster '{CLUSTER}': this cell lost its connection to the cluster ("), text[-3000:]
            assert error[0].endswith("the cluster is intact and this kernel still attached, but TensorFlow may have "
                                     "dropped the variables it made there when it reconnected: run the cells that "
                                     "build the model again, then this one (a fit with dtf.BackupAndRestore() "
                                     "resumes from its last backup)"), error
            assert "Traceback" not in text, text[-3000:]
        else:
            assert "loop done" in text, text[-3000:]
        print(f"the cut cell: {status}: {(error or [text.strip()[-200:]])[0]}")
        # The next cells train, on the same connection: the model's cells again, then the training.
        after = k.ok("with strategy.scope():\n    w = tf.Variable(0.0)\n"
                     "@tf.function\ndef step():\n    w.assign_add(1.0)\n    return w.read_value()\n"
                     "for _ in range(20):\n    coordinator.schedule(step)\ncoordinator.join()\n"
                     "print('after', float(w.numpy()))")
        assert after.strip().splitlines()[-1] == "after 20.0", after
        assert "attached" in k.ok("cluster")


def test_dtf_train_runs_the_notebook(direct, lab):
    laptop = lab.laptop_dir("nb-train")
    nb = nbformat.read(EXAMPLE, as_version=4)
    for c in nb.cells:  # fewer epochs
        c.source = re.sub(r"^(LOOP_)?EPOCHS = \d+", r"\1EPOCHS = 2", c.source, flags=re.M)
    nbformat.write(nb, laptop / "tutorial.ipynb")
    r = dtf("train", "--output", "out", str(laptop / "tutorial.ipynb"), home=direct, cwd=laptop, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Each cell's output, streamed; the executed notebook saved in the output directory.
    assert f"dtf cluster '{CLUSTER}' (direct network, attached)" in r.stdout
    assert "Epoch 2/2" in r.stdout and "Finished epoch 1" in r.stdout, r.stdout[-3000:]
    assert f"dtf: the executed notebook is in {laptop / 'out' / 'tutorial.ipynb'}" in r.stderr, r.stderr[-3000:]
    executed = nbformat.read(laptop / "out" / "tutorial.ipynb", as_version=4)
    assert any("Final loss is" in o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    for noise in [*NOISE, "INFO:tensorflow:", "triggered tf.function retracing", "IPKernelApp"]:
        assert noise not in r.stdout + r.stderr, (noise, (r.stdout + r.stderr)[-3000:])
    assert_on_laptop_only(lab, laptop, laptop / "out")
    assert kernels_left() == []

    # A cell that raises: the run fails with the program's error (no lost ps: no second attempt).
    nb.cells.insert(2, nbformat.v4.new_code_cell("raise ValueError('not this time')"))
    nbformat.write(nb, laptop / "broken.ipynb")
    r = dtf("train", "--output", "out", str(laptop / "broken.ipynb"), home=direct, cwd=laptop, timeout=900)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "ValueError: not this time" in r.stderr
    assert f"dtf: broken.ipynb: cell 3 raised ValueError; the executed notebook is in {laptop / 'out' / 'broken.ipynb'}" \
        in r.stderr, r.stderr[-3000:]
    assert "attempt 2" not in r.stderr and kernels_left() == []


def test_dtf_train_runs_the_notebook_again_after_a_lost_ps(direct, lab):
    """--attempts as for a script: the notebook runs again from its first cell, in a new kernel."""
    laptop = lab.laptop_dir("nb-attempts")
    loop = LOOP.format(started=laptop / "started", stop=laptop / "stop")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import dtf\ncluster = dtf.connect()\nprint('attempt', dtf.attempt())"),
        nbformat.v4.new_code_cell(loop),
    ])
    nbformat.write(nb, laptop / "loop.ipynb")
    run = Train(direct, laptop / "train.out", "--attempts", "2", str(laptop / "loop.ipynb"), cwd=laptop)
    wait_until(lambda: (laptop / "started").exists(), timeout=300)
    killed = kill_server(direct, "ps:0")
    (laptop / "started").unlink()
    wait_until(lambda: (laptop / "started").exists(), timeout=300)  # attempt 2 runs the loop
    (laptop / "stop").write_text("")
    code, text = run.finish(timeout=600)
    assert code == 0, text[-5000:]
    assert "dtf: ps:0 (server killed by SIGKILL) lost during attempt 1 of 2" in text, text[-5000:]
    assert "attempt 2" in text and "loop done" in text, text[-3000:]
    assert kernels_left() == []
    serving_again(direct, "ps:0", killed)


def test_dtf_down_while_attached_ends_the_running_cell_with_a_clear_error(direct, lab):
    """Last of the module: it takes the shared cluster down."""
    laptop = lab.laptop_dir("nb-down")
    with kernel(direct, laptop) as k:
        k.ok("import dtf\ncluster = dtf.connect()")
        cell = k.start(LOOP.format(started=laptop / "started", stop=laptop / "stop"))
        wait_until(lambda: (laptop / "started").exists(), timeout=300)
        t0 = time.monotonic()
        assert dtf("down", home=direct, timeout=300).returncode == 0
        status, text, error = k.finish(cell, timeout=300)
        print(f"dtf down started -> the cell's error {time.monotonic() - t0:.1f}s later")
        message = (f"dtf: error: cluster '{CLUSTER}' was taken down (`dtf down`) while this process was attached: "
                   f"`dtf up` again, then restart the kernel and connect")
        assert (status, error) == ("error", [message]), text[-3000:]
        assert k.error("cluster.coordinator.join()") == [message]  # the next call too, at once
        # The lease and the watch end with the cluster: the watch's next look at the record (a call's
        # error can come first, found by the call itself) closes the lease and the tunnel, then ends.
        deadline, threads = time.monotonic() + 60, dtf_threads(k)
        while threads != ["dtf-stderr"] and time.monotonic() < deadline:
            time.sleep(0.5)
            threads = dtf_threads(k)
        assert threads == ["dtf-stderr"], threads  # which of dtf's threads outlived the cluster


def test_the_tutorial_notebook_in_a_kernel_through_ssh(lab, write_inventory, home):
    """ssh network mode, the laptop reaching the hosts on port 22 only (a firewall rule): the
    kernel's channels go through dtf's tunnel, opened by connect()."""
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}], cluster="nbssh")
    laptop = lab.laptop_dir("nb-ssh")
    with lab.laptop_blocked():
        r = dtf("up", str(inv), home=home, timeout=300)
        assert r.returncode == 0 and status_json(home)["network"] == "ssh", r.stdout + r.stderr
        with kernel(home, laptop) as k:
            cells = code_cells(EXAMPLE, EPOCHS=2, LOOP_EPOCHS=2)
            assert "dtf cluster 'nbssh' (ssh network, attached)" in k.ok(cells[0])
            assert k.ok("import os\nprint(os.environ['grpc_proxy'].startswith('http://127.0.0.1:'))").strip() == "True"
            for cell in cells[1:]:
                k.ok(cell)
        assert_on_laptop_only(lab, laptop, laptop / "dtf-output")
        assert dtf("down", home=home, timeout=300).returncode == 0
