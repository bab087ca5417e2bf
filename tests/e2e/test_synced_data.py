"""Data to the workers: a CSV file (the inventory's `sync:`) and a TFRecord file (`dtf sync`), made
on the laptop where no lab host sees them (lab.laptop_dir), read by a dataset_fn ON THE WORKERS
through dtf.synced(), train a model under `dtf train`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import dtf

pytestmark = [pytest.mark.lab, pytest.mark.tf, pytest.mark.slow]

PROGRAM = textwrap.dedent('''
    import json
    import dtf
    import tensorflow as tf

    def parse_csv(line):
        x1, x2, y = tf.io.decode_csv(line, [0.0, 0.0, 0.0])
        return tf.stack([x1, x2]), y

    def parse_example(record):
        f = tf.io.parse_single_example(record, {"x": tf.io.FixedLenFeature([2], tf.float32),
                                                "y": tf.io.FixedLenFeature([], tf.float32)})
        return f["x"], f["y"]

    def dataset_fn(context):
        # These ops run on the workers: the files are read from the workers' own disks.
        csv = tf.data.TextLineDataset(dtf.synced("table", "train.csv")).skip(1).map(parse_csv)
        records = tf.data.TFRecordDataset(dtf.synced("records.tfrecord")).map(parse_example)
        return csv.concatenate(records).shuffle(512).repeat().batch(32)

    strategy = dtf.strategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=5)
    history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=20)
    losses = history.history["loss"]
    (dtf.output_dir() / "summary.json").write_text(json.dumps({"first_loss": losses[0], "final_loss": losses[-1]}))
''')


def make_data(laptop: Path) -> None:
    import random

    import tensorflow as tf

    rng = random.Random(0)
    rows = [(rng.uniform(-1, 1), rng.uniform(-1, 1)) for _ in range(600)]
    (laptop / "table").mkdir()
    (laptop / "table" / "train.csv").write_text(
        "x1,x2,y\n" + "".join(f"{a:.5f},{b:.5f},{3 * a - 2 * b + 1:.5f}\n" for a, b in rows[:300]))
    (laptop / "table" / "notes.tmp").write_text("left out by .gitignore")
    (laptop / "table" / ".gitignore").write_text("*.tmp\n")
    with tf.io.TFRecordWriter(str(laptop / "records.tfrecord")) as w:
        for a, b in rows[300:]:
            example = tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[a, b])),
                "y": tf.train.Feature(float_list=tf.train.FloatList(value=[3 * a - 2 * b + 1]))}))
            w.write(example.SerializeToString())
    (laptop / "program.py").write_text(PROGRAM)


def test_a_dataset_fn_reads_synced_csv_and_tfrecord_on_the_workers(lab, write_inventory, home, tmp_path):
    laptop = lab.laptop_dir("sync-e2e")
    make_data(laptop)
    assert not lab.exists("h1", laptop / "table" / "train.csv")  # the hosts cannot see the laptop's files
    ps, w0, w1 = lab.ports(3)
    inv = write_inventory([{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]},
                           {"host": "h2", "workers": [w1]}])
    doc = yaml.safe_load(inv.read_text())
    doc["sync"] = [str(laptop / "table")]
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))

    r = dtf("up", str(inv), home=home, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "synced table (2 file(s)" in r.stdout and "sent to h0" in r.stdout, r.stdout
    r = dtf("sync", str(laptop / "records.tfrecord"), home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    synced = json.loads((home / "state" / "lab.json").read_text())["synced"]
    for h in lab.hosts:
        cache = Path(h.workdir, ".cache", "sync")
        assert lab.exists(h, cache / synced["table"]["digest"] / "train.csv")
        assert not lab.exists(h, cache / synced["table"]["digest"] / "notes.tmp")
        assert lab.exists(h, cache / synced["records.tfrecord"]["digest"] / "records.tfrecord")

    r = dtf("train", "--output", str(tmp_path / "out"), str(laptop / "program.py"), home=home, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["final_loss"] < 0.5 * s["first_loss"], s

    r = dtf("sync", str(laptop / "table"), home=home, timeout=120)
    assert r.returncode == 0 and "h0, h1, h2 had it already (skipped)" in r.stdout, r.stdout
    r = dtf("down", home=home, timeout=120)
    assert r.returncode == 0, r.stderr
    for h in lab.hosts:  # the cluster's files are gone; the synced data stays, as a cache
        assert not Path(h.workdir, "lab").exists()
        assert lab.exists(h, Path(h.workdir, ".cache", "sync", synced["table"]["digest"], "train.csv"))
