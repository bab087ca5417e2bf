"""The laptop's own faults end no run, on the SSH lab: every packet between this machine and the
hosts dropped for a while (a Wi-Fi drop, a VPN reconnecting), and every process of `dtf train`
stopped for a while (a laptop asleep). Each ends with exit 0, every epoch trained, no traceback,
and no task moved, though a spare stands by and `host_timeout` is shorter than the fault.

The faults are short here: the program's gRPC keepalive is made short too (TF_GRPC_DEFAULT_OPTIONS,
which the user's own environment sets as it likes), so that a connection the drop cut is found
dead within seconds, as it is within a minute with dtf's defaults.

The tests share one cluster (this module's xdist group): each leaves it as it found it (every task
serving where it was: each checks so), but the last, whose laptop ends up reaching it through SSH.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from helpers import EXAMPLES, Barrier, Train, down_recorded, dtf, epochs_done, leftovers, status_json, stopped

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.xdist_group("laptop-faults")]

HOST_TIMEOUT = 15  # seconds: shorter than each fault, which must still move nothing
FAULT = float(os.environ.get("DTF_TEST_FAULT", "25"))  # seconds the laptop is cut off, or asleep
KEEPALIVE = {"TF_GRPC_DEFAULT_OPTIONS": "grpc.keepalive_time_ms=1000,grpc.keepalive_timeout_ms=2000"}
EPOCHS, STEPS = 5, 30


@pytest.fixture(scope="module")
def home(lab, tmp_path_factory: pytest.TempPathFactory):
    """The module's cluster: h0 a ps, h1 a worker, h2 a spare; `host_timeout` shorter than the
    faults. Its DTF_HOME; after the module's tests, nothing of it may be left on the hosts."""
    where = tmp_path_factory.mktemp("laptop-faults")
    ps, w0 = lab.ports(2)
    inv = lab.inventory(where / "inventory.yaml", [{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}])
    doc = yaml.safe_load(inv.read_text())
    doc["spares"] = [{"host": "h2", "workdir": lab.host("h2").workdir}]
    doc["host_timeout"] = HOST_TIMEOUT
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    home = where / "home"
    r = dtf("up", str(inv), home=home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    yield home
    down_recorded(home)
    assert leftovers(lab) == {}


def check_every_epoch_once_nothing_moved(home: Path, code: int, text: str) -> list[tuple[int, int]]:
    assert code == 0, text[-5000:]
    assert "Traceback" not in text, text[-5000:]
    assert "moved to spare" not in text and "unanswered for" not in text, text[-5000:]
    done = epochs_done(text)
    # Every epoch trained; an attempt after the fault resumes right after the last epoch backed up.
    assert sorted({e for e, _ in done}) == list(range(1, EPOCHS + 1)), done
    assert done[-1][0] == EPOCHS
    rows = status_json(home)["tasks"]
    assert [(r["task"], r["host"], r["state"]) for r in rows] == [("ps:0", "h0", "alive"), ("worker:0", "h1", "alive")]
    return done


def test_a_dropped_network_is_waited_out_and_the_run_resumes(lab, home, tmp_path):
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{EPOCHS} done")
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"), "--network-wait", "300",
                *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS),
                              "--no-export"), env=KEEPALIVE)
    with contextlib.ExitStack() as cut:
        with barrier.held(run):  # the program goes on training into the drop
            cut.enter_context(lab.laptop_cut())
        run.wait_for(r"no task of cluster 'lab' answers this machine", timeout=120)
        time.sleep(FAULT)
    code, text = run.finish(timeout=600)
    done = check_every_epoch_once_nothing_moved(home, code, text)
    assert re.search(r"cluster 'lab' answers again after \d+s", text), text[-3000:]
    assert "the program lost its connection to cluster 'lab' during attempt 1" in text, text[-3000:]
    assert "the cluster is intact" in text and "running the program again (attempt 2 of 3)" in text
    assert {a for _, a in done} == {1, 2}


def test_a_laptop_asleep_blames_no_host(lab, home, tmp_path):
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{EPOCHS} done")
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS),
                              "--no-export"), env=KEEPALIVE)
    with barrier.held(run):
        pass
    with stopped(run.proc.pid) as tree:
        assert len(tree) > 2  # dtf train, its program, its ssh sessions
        time.sleep(FAULT)
    code, text = run.finish(timeout=600)
    check_every_epoch_once_nothing_moved(home, code, text)


def test_a_laptop_that_no_longer_reaches_the_tf_ports_directly_goes_through_ssh(lab, home, tmp_path):
    """A laptop that wakes on another network, whose new address the hosts' firewall refuses (here,
    the same seen from the laptop: its own firewall drops every packet to the TF ports from then
    on, SSH left open): the next attempt carries the training's connections through SSH."""
    if lab.mode != "netns":
        pytest.skip("blocking the laptop needs network namespaces (lab in loopback mode)")
    assert status_json(home)["network"] == "direct"  # network: auto, and up reached the tasks directly
    barrier = Barrier(tmp_path / "barrier", rf"^epoch 2/{EPOCHS} done")
    run = Train(home, tmp_path / "train.out", "--output", str(tmp_path / "out"),
                *barrier.argv(EXAMPLES / "mnist_fit.py", "--epochs", str(EPOCHS), "--steps-per-epoch", str(STEPS),
                              "--no-export"), env=KEEPALIVE)
    with contextlib.ExitStack() as blocked:
        with barrier.held(run):
            blocked.enter_context(lab.laptop_blocked(drop=True))
        code, text = run.finish(timeout=600)
        done = check_every_epoch_once_nothing_moved(home, code, text)
        assert "answers this machine through SSH only now" in text, text[-3000:]
        assert {a for _, a in done} == {1, 2}
        assert status_json(home)["network"] == "ssh"
