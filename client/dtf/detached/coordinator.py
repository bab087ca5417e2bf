"""`python -m dtf.detached.coordinator RUN`: a detached run's coordinator, on a host of the cluster.

The laptop's `dtf train --detach` (dtf.detached.start) put the run's spec in RUN (DetachedLayout)
and started this as a supervised task of the host (Layout.CHIEF), with dtf's own package on its
PYTHONPATH (the host has TensorFlow, not dtf). It runs what `dtf train` runs on the laptop
(dtf.program.train: the attempts, the lease, the repair), on the cluster as this host sees it
(dtf.detached.vantage), and exits with the program's exit code, which its supervisor keeps for
`dtf attach`, `dtf status` and `dtf down`. Everything it and the program print goes to
RUN/output.log, which `dtf attach` follows.

It imports what the hosts have: the standard library, TensorFlow (in the program only), and dtf's
own modules that need nothing else (no typer, rich, yaml, paramiko, pathspec).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dtf_server.protocol import EXIT_STATUS_ENV, DetachedLayout

CHECK_TIMEOUT = 30.0  # seconds each host gets to answer the coordinator's first look


def say(message: str) -> None:
    print(f"dtf: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    run = os.path.abspath(os.path.expanduser(argv[0]))
    log = os.open(os.path.join(run, DetachedLayout.OUTPUT_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    with open(os.path.join(run, DetachedLayout.SPEC)) as f:
        spec: dict[str, Any] = json.load(f)
    # A job step's own variables (a Slurm node): srun here must start steps of the job, not of this step.
    for name in [n for n in os.environ if n.startswith("SLURM_") and n != "SLURM_CONF"]:
        del os.environ[name]
    for name in ("DTF_OUTPUT_DIR", "DTF_JOINED", EXIT_STATUS_ENV):  # its supervisor's, for a program copy
        os.environ.pop(name, None)
    # The coordinator takes no GPU, as on a laptop: its host's GPUs are its workers' (TensorFlow
    # would take their memory at its start).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DTF_HOME"] = os.path.join(run, DetachedLayout.HOME)
    # What dtf caches (a launcher it builds to start a task again on a host that lost it) stays in
    # the run's directory, which `dtf down` and the lease remove: nothing of it in the user's ~/.cache.
    os.environ["DTF_CACHE"] = os.path.join(run, DetachedLayout.HOME, "cache")
    try:
        record = prepare(run, spec)
    except Exception as e:  # one line in the run's output: `dtf train --detach` shows it
        say(f"error: {e}")
        shutil.rmtree(os.path.join(run, DetachedLayout.SSH), ignore_errors=True)
        ended(run, 2)
        return 2
    from dtf.errors import DtfError
    from dtf.hostops.parallel import HostOps
    from dtf.program.train import run_program
    from dtf.ui import show_shares

    options = spec["options"]
    output = spec.get("output")
    started = time.monotonic()
    code = 1
    try:
        code = run_program(record, os.path.join(run, spec["program"]), list(spec["args"]),
                           os.path.join(run, output) if output else None, attempts=options["attempts"],
                           ps_wait=options["ps_wait"], connect_timeout=options["connect_timeout"],
                           verbose=options["verbose"], hook_env=options["hook_env"],
                           network_wait=options["network_wait"],
                           report=lambda shares: show_shares(shares, time.monotonic() - started))
    except DtfError as e:
        say(f"error: {e}")
        code = e.exit_code
    finally:
        HostOps(record.plan).provider.close()  # its SSH masters: nothing of the run outlives it
        shutil.rmtree(os.path.join(run, DetachedLayout.SSH), ignore_errors=True)  # nor its key
        ended(run, code)
    return code


def ended(run: str, code: int) -> None:
    """How the run ended (DetachedLayout.ENDED), whole or not at all: what `dtf attach`, `status`
    and `down` say, and what stays of it once the lease lapsed and its supervisor's files are gone."""
    from dtf.program.figures import write_atomic
    from dtf_server.protocol import exit_reason

    write_atomic(Path(run, DetachedLayout.ENDED), {"exit_code": code, "reason": exit_reason(code), "time": time.time()})


def prepare(run: str, spec: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The run's working directory (the laptop's, its program's folder in place), the cluster as
    this host sees it, saved as the record of this run's DTF_HOME, and every host reached once."""
    from dtf.cluster import state
    from dtf.cluster.state import Record
    from dtf.detached import vantage

    work = os.path.join(run, DetachedLayout.WORK)
    source = os.path.normpath(os.path.join(run, spec["shipped_from"]))
    target = os.path.normpath(os.path.join(run, spec["program_dir"]))
    shutil.copytree(source, target, dirs_exist_ok=True)  # copy2: mtimes kept, so `collect` sees changes
    os.makedirs(work, exist_ok=True)
    shipped(run)
    os.chdir(work)
    hosts = {name: vantage.HostSsh(user=h["user"], port=int(h["port"]), host_keys=tuple(h["host_keys"]))
             for name, h in spec.get("ssh", {}).items()}
    laptop = Record.from_dict(spec["record"])
    record = vantage.vantage(laptop, spec["here"], run)
    if hosts:
        _, config, known = vantage.ssh_files(run)
        with open(config, "w") as f:
            f.write(vantage.ssh_config(record.plan, spec["here"], run, hosts))
        with open(known, "w") as f:
            f.write(vantage.known_hosts(hosts))
    with state.locked():
        state.save(record)
    reach_every_host(record)
    return record


def shipped(run: str) -> None:
    """work/'s files as shipped (DetachedLayout.SHIPPED: path -> [size, mtime in ns]): the host's
    `detached --collect` brings back the others, and those that changed."""
    work = os.path.join(run, DetachedLayout.WORK)
    files: dict[str, list[int]] = {}
    for directory, _, names in os.walk(work):
        for name in names:
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            files[os.path.relpath(path, work)] = [st.st_size, st.st_mtime_ns]
    with open(os.path.join(run, DetachedLayout.SHIPPED), "w") as f:
        json.dump(files, f)


def reach_every_host(record: Any) -> None:
    """Each host (spares too) answers a command from here, or the run does not start: said in one
    line naming the hosts and why."""
    from dtf.hostops.parallel import HostOps
    from dtf.hosts.base import HostError

    plan = record.plan
    ops = HostOps(plan)

    def answer(hp: Any) -> None:
        with ops.runner(hp) as t:
            r = t.run(["true"], timeout=CHECK_TIMEOUT)
            if not r.ok:
                raise HostError((r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1])

    outcomes = ops.each_host(answer, [*plan.hosts, *plan.spares])
    failed = [f"{name} ({o.reason})" for name, o in outcomes.items() if not o.ok]
    if failed:
        raise RuntimeError(f"this host cannot reach {', '.join(failed)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
