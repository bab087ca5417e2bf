"""`connection: local`: the whole product on this machine with real TensorFlow servers, no SSH."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import (
    LOCAL_CLUSTER,
    Train,
    assert_one_line_error,
    dtf,
    pids_alive,
    status_json,
    train_interrupted,
    wait_until,
    write_local_inventory,
)

pytestmark = pytest.mark.tf

TINY = textwrap.dedent("""
    import sys
    import dtf
    import tensorflow as tf
    strategy, coordinator = dtf.strategy(), dtf.coordinator()
    with strategy.scope():
        v = tf.Variable(0.0)
    @tf.function
    def step():
        v.assign_add(1.0)
        return v.read_value()
    for _ in range(10):
        coordinator.schedule(step)
    coordinator.join()
    print("counted", int(v.numpy()), "workers", dtf.num_workers(), "args", sys.argv[1:])
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


@pytest.fixture(autouse=True)
def always_down(tmp_path: Path):
    """Whatever a test does, no server outlives it."""
    yield
    if (tmp_path / "home" / "state" / "loc.json").exists():
        dtf("down", home=tmp_path / "home")


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    return write_local_inventory(tmp_path)


def test_local_cluster_up_train_status_logs_down(tmp_path: Path, local_inventory: Path):
    home = tmp_path / "home"
    r = dtf("up", str(local_inventory), home=home)
    assert r.returncode == 0, r.stderr
    assert "cluster loc is up" in r.stdout
    record = json.loads((home / "state" / "loc.json").read_text())
    pids = list(record["pids"].values())
    assert len(pids_alive(pids)) == 3
    try:
        rows = status_json(home)["tasks"]
        assert [(x["task"], x["state"], x["serving"]) for x in rows] == [
            ("ps:0", "alive", True), ("worker:0", "alive", True), ("worker:1", "alive", True)]

        again = dtf("up", str(local_inventory), home=home)
        assert again.returncode == 0 and "already up" in again.stdout
        assert json.loads((home / "state" / "loc.json").read_text())["pids"] == record["pids"]

        log = dtf("logs", "worker:1", home=home)
        assert log.returncode == 0 and "worker:1 serving on port" in log.stdout

        program = tmp_path / "tiny.py"
        program.write_text(TINY)
        run = dtf("train", str(program), "3", "--flag", home=home)
        assert "counted 10 workers 2 args ['3', '--flag']" in run.stdout, run.stderr
        assert run.returncode == 3  # the program's exit code is dtf's
    finally:
        down = dtf("down", home=home)
    assert down.returncode == 0, down.stderr
    assert "3 server(s) stopped" in down.stdout
    assert pids_alive(pids) == []
    assert not (tmp_path / "work" / "loc").exists()
    assert not (home / "state" / "loc.json").exists()
    assert_one_line_error(dtf("train", str(program), home=home), 5, "run `dtf up INVENTORY` first")


def test_port_busy_is_refused_and_nothing_is_left(tmp_path: Path, local_inventory: Path):
    text = local_inventory.read_text()
    busy_port = int(text.split("workers: [")[1].split(",")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy_port))
        s.listen()
        r = dtf("up", str(local_inventory), home=tmp_path / "home")
    assert_one_line_error(r, 4, f"localhost: port busy: {busy_port} (worker:0)")
    assert not (tmp_path / "home" / "state" / "loc.json").exists()
    assert not (tmp_path / "work" / "loc").exists()


def test_crashing_server_reports_its_log_and_rolls_back(tmp_path: Path, local_inventory: Path):
    # A python whose TensorFlow passes the version check (package metadata) but cannot be
    # imported: the servers crash after the launcher started them.
    broken = tmp_path / "broken" / "tensorflow"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import sys\nprint('boom: no server here', file=sys.stderr)\nsys.exit(3)\n")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nPYTHONPATH={broken.parent} exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    local_inventory.write_text(local_inventory.read_text().replace(
        "connection: local\n", f"connection: local\n    python: {fake}\n"))
    r = dtf("up", str(local_inventory), home=tmp_path / "home")
    assert_one_line_error(r, 4, "server crashed", "exited with code 3", "boom: no server here")
    assert not (tmp_path / "work" / "loc").exists()


def test_train_fails_fast_naming_dead_tasks(tmp_path: Path, local_inventory: Path):
    home = tmp_path / "home"
    assert dtf("up", str(local_inventory), home=home).returncode == 0
    try:
        record = json.loads((home / "state" / "loc.json").read_text())
        os.killpg(record["pids"]["worker:1"], signal.SIGKILL)  # supervisor and server: dead for good
        program = tmp_path / "tiny.py"
        program.write_text(TINY)
        r = dtf("train", str(program), home=home, timeout=60)
        assert_one_line_error(r, 7, "not serving: worker:1 (localhost")
        st = dtf("status", home=home)
        assert st.returncode == 7 and "dead" in st.stdout
    finally:
        assert dtf("down", home=home).returncode == 0


SLOW = textwrap.dedent("""
    import sys, time
    import dtf
    import tensorflow as tf
    strategy, coordinator = dtf.strategy(), dtf.coordinator()
    try:
        print("training", flush=True)  # inside: Ctrl-C may come while print returns
        time.sleep(600)  # until the Ctrl-C: the test's own deadline (60 s) ends first
    except KeyboardInterrupt:
        print("program got Ctrl-C", flush=True)
        sys.exit(130)
""")


@LOCAL_CLUSTER
def test_ctrl_c_stops_the_program_and_leaves_the_cluster_up(tmp_path: Path, local_cluster):
    _, home = local_cluster
    program = tmp_path / "slow.py"
    program.write_text(SLOW)
    code, out, err = train_interrupted(home, str(program), timeout=60)
    assert code == 130, (out, err)
    assert "program got Ctrl-C" in out, (out, err)
    assert "cluster 'loc' is still up" in err and "Traceback" not in err
    assert [r["state"] for r in status_json(home)["tasks"]] == ["alive"] * 3


@LOCAL_CLUSTER
def test_a_folder_named_dtf_in_the_working_directory_and_beside_the_program(tmp_path: Path, local_cluster):
    """`dtf train` (the installed command) run from the folder that holds dtf's clone, of a program
    whose own folder holds an empty `dtf` folder: it trains with the installed dtf, no traceback.
    (Python took such a folder for the package `dtf`, a namespace package, before an editable install.)"""
    _, home = local_cluster
    (tmp_path / "dtf" / "client").mkdir(parents=True)
    (tmp_path / "app" / "dtf").mkdir(parents=True)
    (tmp_path / "app" / "tiny.py").write_text(TINY)
    command = Path(sys.executable).parent / "dtf"
    r = subprocess.run([str(command), "train", "app/tiny.py"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "DTF_HOME": str(home)}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "counted 10 workers 2 args []" in r.stdout


TF_FIRST = textwrap.dedent("""
    import sys
    import tensorflow as tf
    if sys.argv[1] == "used":
        tf.keras.layers  # binds tf.keras: Keras 3, TF_USE_LEGACY_KERAS being unset
    import dtf
    try:
        cluster = dtf.connect()
    except dtf.notebook.connection.ConnectError as e:
        sys.exit(f"refused: {e}")
    import numpy as np
    from tensorflow.keras import layers
    with cluster.strategy.scope():
        model = tf.keras.Sequential([layers.Input(shape=(4,)), layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((64, 4), "float32"), np.ones((64, 1), "float32")))
    model.fit(data.repeat().batch(8), epochs=2, steps_per_epoch=5, verbose=0)
    print("connected", type(cluster.strategy).__name__, type(model).__module__.split(".")[0],
          layers.Dense.__module__.split(".")[0], int(model.optimizer.iterations.numpy()))
    cluster.close()
""")


@LOCAL_CLUSTER
def test_connect_after_import_tensorflow_gets_tf_keras_unless_tf_keras_was_used(tmp_path: Path, local_cluster):
    """A notebook's first cell `import tensorflow as tf`, its second `import dtf; dtf.connect()`: the
    process connects and trains with tf-keras (`tf.keras`, `from tensorflow.keras import ...`), since
    nothing used tf.keras before; with tf.keras used first (bound to Keras 3), one line refuses it."""
    _, home = local_cluster
    program = tmp_path / "tf_first.py"
    program.write_text(TF_FIRST)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF_CONFIG", "DTF_CLUSTER")}
    env["DTF_HOME"] = str(home)
    fresh = subprocess.run([sys.executable, str(program), "fresh"], capture_output=True, text=True, timeout=300,
                           env=env, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "connected ParameterServerStrategyV2 tf_keras tf_keras 10" in fresh.stdout, fresh.stdout
    assert "dtf: warning" not in fresh.stderr, fresh.stderr[-3000:]  # Keras 3, imported by TensorFlow itself
    used = subprocess.run([sys.executable, str(program), "used"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert used.returncode == 1 and "connected" not in used.stdout, used.stderr[-3000:]
    assert used.stderr.strip().endswith("refused: tf.keras is already Keras 3 in this process (used before dtf "
                                        "was imported), which has no ParameterServerStrategy: import dtf before "
                                        "the first use of tf.keras (in a notebook: restart the kernel, then import "
                                        "dtf first)"), used.stderr[-3000:]


def test_the_same_program_runs_without_a_cluster(tmp_path: Path):
    program = tmp_path / "tiny.py"
    program.write_text(TINY)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "DTF_CLUSTER")}
    r = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "counted 10 workers 2 args []" in r.stdout
    assert "started an in-process cluster with 1 ps and 2 workers" in r.stderr


def test_down_keep_logs_and_never_kills_what_it_did_not_start(tmp_path: Path, local_inventory: Path):
    home = tmp_path / "home"
    # Fake servers: this is about what `down` stops, not about what serves.
    assert dtf("up", str(local_inventory), home=home, env={"DTF_SERVER": "fake"}).returncode == 0
    # worker:1 dies; its pid is then taken over (as pids are reused) by a stranger process.
    task_dir = tmp_path / "work" / "loc" / "worker-1"
    record = json.loads((task_dir / "pid.json").read_text())
    os.kill(record["pid"], signal.SIGKILL)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (task_dir / "pid.json").write_text(json.dumps({**record, "pid": stranger.pid}))
        r = dtf("down", "--keep-logs", home=home)
        assert r.returncode == 0, r.stderr
        assert "2 server(s) stopped" in r.stdout
        assert stranger.poll() is None  # not ours: untouched
    finally:
        stranger.kill()
        stranger.wait()
    left = sorted(str(p.relative_to(tmp_path / "work")) for p in (tmp_path / "work").rglob("*"))
    assert left == ["loc", "loc/ps-0", "loc/ps-0/log", "loc/worker-0", "loc/worker-0/log",
                    "loc/worker-1", "loc/worker-1/log"]


BACKUP = textwrap.dedent("""
    import dtf
    import numpy as np
    import tensorflow as tf
    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((64, 4), "float32"), np.ones((64, 1), "float32")))
    backup = dtf.BackupAndRestore("relative/backup", delete_checkpoint=False)
    model.fit(data.repeat().batch(8), epochs=2, steps_per_epoch=5, callbacks=[backup], verbose=0)
    print("iterations", int(model.optimizer.iterations.numpy()))
""")


@LOCAL_CLUSTER
def test_backup_and_restore_writes_and_reads_on_the_coordinator(tmp_path: Path, local_cluster):
    """A relative backup_dir shows who does the file I/O: the coordinator writes below ITS working
    directory, a ps would write below its own (its task directory). A second run restores from
    the backup: the epochs are done, so it trains no more."""
    inventory, home = local_cluster
    program = tmp_path / "backup.py"
    program.write_text(BACKUP)
    laptop = tmp_path / "laptop"
    laptop.mkdir()
    for _ in range(2):
        r = dtf("train", str(program), home=home, cwd=laptop, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "iterations 10" in r.stdout
    assert list((laptop / "relative" / "backup" / "chief").glob("ckpt-*.index"))
    assert not list((inventory.parent / "work").rglob("relative"))  # the tasks' workdir


@LOCAL_CLUSTER
def test_a_second_dtf_home_cannot_take_over_a_running_cluster(tmp_path: Path, local_cluster):
    """Same inventory, another DTF_HOME (another laptop, another user): refused, and its rollback
    leaves the running cluster alone."""
    local_inventory, home = local_cluster
    other = tmp_path / "other"
    pids = {r["task"]: r["server_pid"] for r in status_json(home)["tasks"]}
    r = dtf("up", str(local_inventory), home=other)
    assert_one_line_error(r, 4, "cluster 'loc' already runs here (ps:0, worker:0, worker:1",
                          "started by another dtf")
    assert not (other / "state" / "loc.json").exists()
    assert {r["task"]: r["server_pid"] for r in status_json(home)["tasks"]} == pids
    assert [r["state"] for r in status_json(home)["tasks"]] == ["alive"] * 3


UNTIL_TOLD = textwrap.dedent("""
    import os, sys
    import dtf
    import numpy as np
    import tensorflow as tf
    stop = sys.argv[1]
    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=5)
    data = tf.data.Dataset.from_tensor_slices((np.ones((64, 4), "float32"), np.ones((64, 1), "float32")))

    class UntilTold(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(f"epoch {epoch + 1} done", flush=True)
            self.model.stop_training = os.path.exists(stop)

    model.fit(data.repeat().batch(8), epochs=100000, steps_per_epoch=20, callbacks=[UntilTold()], verbose=0)
""")


@LOCAL_CLUSTER
def test_top_shows_the_training_dtf_train_publishes(tmp_path: Path, local_cluster):
    """While `dtf train` runs, `dtf top --json` shows its steps/s (overall and per worker), the steps
    per closure the program chose, the attempt; once it ended, no training and no files left."""
    _, home = local_cluster
    program, stop = tmp_path / "until_told.py", tmp_path / "stop"
    program.write_text(UNTIL_TOLD)
    run = Train(home, tmp_path / "train.out", str(program), str(stop))
    def training_seen() -> dict | None:
        r = dtf("top", "--json", home=home, timeout=120)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        return doc if (doc["training"] or {}).get("steps_per_s") else None

    try:
        run.wait_for(r"^epoch 1 done", timeout=300)
        doc = wait_until(training_seen, timeout=300, every=0.5)  # a second with steps in it
    finally:
        stop.write_text("")
    code, text = run.finish(timeout=120)
    assert code == 0, text[-3000:]
    train = doc["training"]
    assert (train["mode"], train["attempt"], train["attempts"], train["steps_per_closure"], train["packing"]) == \
        ("ps", 1, 3, 5, "program"), train
    assert train["steps"] >= 20 and train["steps_per_s"] > 0, train
    workers = {r["task"]: r["steps_per_s"] for r in doc["tasks"] if r["job"] == "worker"}
    assert set(workers) == {"worker:0", "worker:1"} and sum(w or 0 for w in workers.values()) > 0, doc["tasks"]
    assert not (home / "live" / "loc").exists()
    r = dtf("top", "--json", home=home, timeout=120)
    assert json.loads(r.stdout)["training"] is None


SMALL_FIT = textwrap.dedent("""
    import dtf
    import numpy as np
    import tensorflow as tf
    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    data = tf.data.Dataset.from_tensor_slices((np.ones((64, 4), "float32"), np.ones((64, 1), "float32")))
    model.fit(data.repeat().batch(8), epochs=2, steps_per_epoch=6, verbose=0)
    print("iterations", int(model.optimizer.iterations.numpy()))
""")
DTF_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d )?dtf: ")  # the supervisor's (with its time) and the server's


@LOCAL_CLUSTER
def test_after_a_training_the_run_says_what_each_worker_did_and_logs_hold_no_tensorflow_line(
        tmp_path: Path, local_cluster):
    _, home = local_cluster
    program = tmp_path / "small_fit.py"
    program.write_text(SMALL_FIT)
    r = dtf("train", str(program), home=home, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iterations 12" in r.stdout
    # What each worker did: 2 epochs of 6 steps, 2 steps per closure, every closure counted once.
    lines = r.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("dtf: what each worker did in "))
    assert lines[head + 1].split() == ["task", "host", "closures", "steps", "share", "time"], r.stderr
    rows = [line.split() for line in lines[head + 2:]]
    assert [row[:2] for row in rows] == [["worker:0", "localhost"], ["worker:1", "localhost"]], r.stderr
    assert (sum(int(row[2]) for row in rows), sum(int(row[3]) for row in rows)) == (6, 12), r.stderr

    # The worker's log, after that training: dtf's lines only, TensorFlow's with --all.
    log = dtf("logs", "worker:0", home=home)
    assert log.returncode == 0 and "worker:0 serving on port" in log.stdout
    assert [line for line in log.stdout.splitlines() if not DTF_LINE.match(line)] == [], log.stdout
    everything = dtf("logs", "worker:0", "--all", "-n", "10000", home=home).stdout
    assert "] Creating sync eager service context" in everything and "device_count {" in everything
    assert everything.count("\n") > log.stdout.count("\n")
    last = dtf("logs", "worker:0", "-n", "1", home=home).stdout
    assert last == log.stdout.splitlines(keepends=True)[-1]
