"""A `dtf train --collective` program whose worker 1 never makes its strategy (it hangs before,
as a copy stuck loading its data would): MultiWorkerMirroredStrategy on the others waits for it
forever, and dtf's start deadline (--join-timeout) ends the run naming it (test_collective.py)."""

import json
import os
import time

task = json.loads(os.environ["TF_CONFIG"])["task"]
if task["index"] == 1:
    print("stuck before the strategy", flush=True)
    time.sleep(3600)

import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("the strategy was made", flush=True)
