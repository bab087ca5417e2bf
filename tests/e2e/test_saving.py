"""Item 1 of issue 9: a stock tf-keras program (no dtf helpers) saves on the laptop under `dtf train`,
on hosts that do not share the laptop's files (each lab host has a /srv of its own)."""

from __future__ import annotations

import pytest

from helpers import NOISE, REPO, dtf, saved_on_hosts

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.slow]

PROGRAMS = REPO / "tests" / "e2e" / "programs"


def test_a_stock_keras_program_saves_every_file_on_the_laptop_and_none_on_a_host(lab, write_inventory, home):
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}], cluster="saving")
    r = dtf("up", str(inv), home=home)
    assert r.returncode == 0, r.stderr
    laptop = lab.laptop_dir("stock")  # the program's working directory: no host sees it
    assert not any(lab.exists(h, laptop) for h in lab.hosts)
    before = {h.name: private_files(lab, h) for h in lab.hosts}  # other tests may have left files there

    r = dtf("train", str(PROGRAMS / "stock_keras.py"), "--explicit-none", home=home, cwd=laptop, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "stock: ok" in r.stdout
    # What TensorFlow does without dtf's default (the program names device None itself, and that
    # wins): the ps writes next to its variables, in its own working directory, and fails.
    assert "explicit None: NotFoundError" in r.stdout, r.stdout[-2000:]

    saved = {str(p.relative_to(laptop)) for p in laptop.rglob("*") if p.is_file()}
    for expected in ["training_checkpoints/checkpoint", "training_checkpoints/ckpt_2.index",  # ModelCheckpoint, weights
                     "models/model_2/saved_model.pb", "models/model_2/variables/variables.index",  # ... whole model
                     "saved_model/saved_model.pb", "saved_model/variables/variables.index",  # model.save
                     "weights/w.index", "manager/checkpoint"]:  # save_weights, CheckpointManager
        assert expected in saved, sorted(saved)
    assert any(p.startswith("backup/") and p.endswith(".index") for p in saved), sorted(saved)  # BackupAndRestore
    assert any(p.startswith("logs/train/events.out.tfevents.") for p in saved), sorted(saved)  # TensorBoard

    assert saved_on_hosts(lab, "saving") == []  # nothing in the tasks' directories on any host...
    for h in lab.hosts:  # ... nor in its /srv
        assert not lab.exists(h, laptop)
        assert private_files(lab, h) == before[h.name], h.name

    # TensorFlow's chatter is not shown (without --verbose); the program's own output is.
    assert "Epoch 2/2" in r.stdout
    for noise in [*NOISE, "Ignoring error status when releasing", "triggered tf.function retracing"]:
        assert noise not in r.stderr, (noise, r.stderr[-3000:])


def private_files(lab, h) -> list[str]:
    """Everything below the host's own /srv."""
    srv = lab.run(h, ["find", "/srv", "-mindepth", "1"], timeout=10)
    assert srv.returncode == 0, (h.name, srv.stderr)
    return sorted(srv.stdout.split())
