"""The lease watch of an allocation dtf submitted, run on the job's first node as
`python -c THIS LEASE_FILE POLL` (dtf.providers.slurm.commands.watch_script): it cancels the job (scancel)
once the cluster's lease there lapsed, looking every POLL seconds. A lease file written before the
watch began is an earlier job's (a job ended by its lapse may end before its supervisors removed
the files): ignored, or the new job would end at once. Standard library only: the node's python."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def watch(path: str, poll: float) -> None:
    begun = time.time()
    last: dict[str, Any] | None = None
    while True:
        try:
            with open(path) as f:
                lease = json.load(f)
            written = os.stat(path).st_mtime
        except (OSError, ValueError):
            lease = None
        if lease is not None and written >= begun - 1:
            last = lease
        if last is not None and last["ttl"] and time.time() > last["renewed"] + last["ttl"]:
            os.execvp("scancel", ["scancel", os.environ["SLURM_JOB_ID"]])
        time.sleep(poll)


if __name__ == "__main__":
    watch(sys.argv[1], float(sys.argv[2]))
