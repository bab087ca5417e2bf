"""`dtf up` / `dtf down` on the Slurm lab against the floor by hand: prints, asserts nothing.

    sudo .venv/bin/python bench/slurm_up.py [--repeat 3]

Both with fake servers (DTF_SERVER=fake: the orchestration, not TensorFlow's import), 2 nodes,
1 ps and 1 worker on each, and both on dtf as a user installs it (common.as_installed: the CLI, the
nodes' launchers and servers, and the floor's servers and readiness loop run on a python without
the development environment's editable-install hook, which slows each python's start).

The floor is what a user would type by hand, in one SSH command to the login host: `salloc
--no-shell` (it returns once the allocation is granted), one `srun
--overlap` step per task (the fake server of dtf's own launcher, read from this checkout: the lab
shares its disk, so nothing is sent), and a loop on the login host until every task's port
accepts a connection; its `down`: scancel, and squeue until the job has left. (salloc, not
sbatch of a holding job: Slurm grants a salloc in the request, a batch job only at the
scheduler's next pass.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, as_installed, fmt
from helpers import dtf
from slurmlab import SlurmLab

sys.path.insert(0, str(REPO / "tests" / "slurm"))
from test_up_down import inventory  # the tests' own inventory of the Slurm lab

FLOOR_UP = r"""
set -e
job=$(salloc --no-shell -N2 --ntasks-per-node=1 2>&1 | sed -n 's/^salloc: Granted job allocation \([0-9]*\).*/\1/p')
for node in {nodes}; do
  for task in "ps 0 {ps}" "worker 0 {worker}"; do
    set -- $task
    setsid -f srun --quiet --jobid=$job --overlap -N1 -n1 -w $node {python} -c \
      "import sys; sys.path.insert(0, '{server}'); from dtf_server.commands import main; main(sys.argv[1:])" \
      fake --job $1 --index $2 --port $3 --ready /tmp/dtf-floor-$job-$1-$node >/dev/null 2>&1 </dev/null
  done
done
for target in {targets}; do
  until {python} -c "import socket; socket.create_connection(('${{target%:*}}', ${{target#*:}}), 1)" 2>/dev/null; do
    sleep 0.05
  done
done
echo $job
"""
FLOOR_DOWN = r"""
scancel {job}
while [ -n "$(squeue -h -j {job} -o %T 2>/dev/null)" ]; do sleep 0.1; done
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--drop", action="store_true",
                    help="the laptop's packets to the compute nodes dropped, not reset (a site's compute network)")
    args = ap.parse_args()
    name, subnet = os.environ.get("DTF_SLURM_LAB_NAME"), os.environ.get("DTF_SLURM_LAB_SUBNET")
    with tempfile.TemporaryDirectory() as tmp, SlurmLab(root=Path(tmp) / "lab", name=name, subnet=subnet,
                                                      pick=not (name and subnet)) as lab:
        home = Path(tmp) / "home"
        inv = inventory(lab, Path(tmp) / "inv.yaml")
        if args.drop:
            lab.close_to_laptop(drop=True)
        fake = {"DTF_SERVER": "fake"}
        ups, downs, floor_ups, floor_downs = [], [], [], []
        nodes = " ".join(h.name for h in lab.computes)
        targets = " ".join(f"{h.address}:{p}" for h in lab.computes for p in (2222, 2223))
        script = FLOOR_UP.format(nodes=nodes, ps=2222, worker=2223, python=sys.executable,
                                 server=REPO / "server", targets=targets)
        def dtf_pair() -> None:
            t0 = time.monotonic()
            dtf("up", str(inv), home=home, env=fake, check=True)
            ups.append(time.monotonic() - t0)
            t0 = time.monotonic()
            dtf("down", home=home, env=fake, check=True)
            downs.append(time.monotonic() - t0)

        def floor_pair() -> None:
            t0 = time.monotonic()
            r = subprocess.run(lab.ssh_argv(lab.login, script), capture_output=True, text=True, timeout=120)
            floor_ups.append(time.monotonic() - t0)
            assert r.returncode == 0, r.stderr
            t0 = time.monotonic()
            down = FLOOR_DOWN.format(job=r.stdout.split()[-1])
            subprocess.run(lab.ssh_argv(lab.login, down), check=True, timeout=120)
            floor_downs.append(time.monotonic() - t0)

        # Each goes first every other time: how soon Slurm runs a job depends on what the one
        # before left (its nodes still completing), and on which of its scheduler's passes the
        # submission meets.
        for i in range(args.repeat):
            for run in ((dtf_pair, floor_pair) if i % 2 == 0 else (floor_pair, dtf_pair)):
                run()
        up, floor = sorted(ups)[len(ups) // 2], sorted(floor_ups)[len(floor_ups) // 2]
        block = "dropped" if args.drop else "reset"
        print(f"slurm lab: 2 nodes x (1 ps, 1 worker), fake servers, the laptop's connections to the nodes "
              f"{block}; load {os.getloadavg()[0]:.1f}")
        print(f"dtf up          {fmt(ups)}")
        print(f"floor up        {fmt(floor_ups)}")
        print(f"dtf down        {fmt(downs)}")
        print(f"floor down      {fmt(floor_downs)}")
        print(f"dtf up / floor: {up / floor:.2f}x (goal <= 1.2x)")


if __name__ == "__main__":
    as_installed()
    main()
