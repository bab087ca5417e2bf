"""`dtf train`: run the user's program here, as the chief (coordinator) of a recorded cluster."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dtf.errors import ClusterDown, DtfError
from dtf.netutil import free_ports, port_open
from dtf.plan import Plan

PROBE_TIMEOUT = 3.0
# After Ctrl-C: seconds until the program's main thread is sent SIGINT itself, until SIGTERM,
# and until SIGKILL.
INTERRUPT_STEPS = (3.0, 10.0, 15.0)
TGKILL = {"x86_64": 234, "aarch64": 131}  # syscall numbers (Linux)


def interrupt_main_thread(pid: int) -> bool:
    """Send SIGINT to the main thread of process `pid` (its thread id is its pid).

    A terminal's Ctrl-C goes to the process, and the kernel hands it to any thread that does not
    block it: in a TensorFlow program, one of a hundred runtime threads. CPython then only sets a
    flag; the main thread, blocked in a C call (a sleep, a coordinator wait), never wakes to raise
    KeyboardInterrupt (https://docs.python.org/3/library/signal.html#execution-of-python-signal-handlers).
    Aimed at the main thread, the signal interrupts that call. Linux only; False elsewhere.
    """
    number = TGKILL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(number, pid, pid, int(signal.SIGINT)) == 0


def dead_tasks(plan: Plan, timeout: float = PROBE_TIMEOUT) -> list[str]:
    """Tasks whose port does not accept a connection from here (probed in parallel)."""
    tasks = plan.tasks()
    with ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
        alive = list(pool.map(lambda t: port_open(t.addr_host, t.port, timeout), tasks))
    return [f"{t.name} ({t.host}, {t.address})" for t, ok in zip(tasks, alive) if not ok]


def tf_config(plan: Plan, chief_address: str) -> dict:
    """TF_CONFIG for the coordinator: the cluster of the plan, with this program as chief."""
    return {"cluster": {**plan.cluster_spec(), "chief": [chief_address]},
            "task": {"type": "chief", "index": 0}}


def program_env(plan: Plan, chief_host: str, output: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["TF_CONFIG"] = json.dumps(tf_config(plan, f"{chief_host}:{free_ports(1)[0]}"))
    env["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf-keras: model.fit works under PS (FACTS.md)
    env["GRPC_FAIL_FAST"] = "use_caller"
    env["DTF_CLUSTER"] = plan.cluster
    if output:
        env["DTF_OUTPUT_DIR"] = str(Path(output).resolve())
    return env


def run_program(plan: Plan, record: dict, program: str, args: list[str], output: str | None) -> int:
    """Run `python PROGRAM ARGS` with the cluster's TF_CONFIG; return its exit code.

    Ctrl-C reaches the program (it is in our terminal's process group) and stops it; dtf waits
    for it and leaves the cluster up. SIGTERM sent to dtf alone is passed on to the program.
    """
    if not Path(program).is_file():
        raise DtfError(f"program not found: {program}")
    dead = dead_tasks(plan)
    if dead:
        raise ClusterDown(f"cluster {plan.cluster!r}: not serving: {', '.join(dead)} "
                          f"(see `dtf status`, `dtf logs TASK`)")
    env = program_env(plan, record.get("chief_host") or "127.0.0.1", output)
    interrupted_at: float | None = None
    proc: subprocess.Popen | None = None

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupted_at
        if interrupted_at is None:
            interrupted_at = time.monotonic()  # the terminal sent it to the program too

    def on_sigterm(signum: int, frame: object) -> None:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    # Handlers (not SIG_IGN): a handler resets to the default in the child, so the program still
    # gets its KeyboardInterrupt.
    old_int = signal.signal(signal.SIGINT, on_sigint)
    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        proc = subprocess.Popen([sys.executable, program, *args], env=env)
        code = _wait(proc, lambda: interrupted_at)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if interrupted_at is not None:
        print(f"dtf: program interrupted; cluster {plan.cluster!r} is still up "
              f"(`dtf down` stops it)", file=sys.stderr)
    return 128 - code if code < 0 else code


def _wait(proc: subprocess.Popen, interrupted_at) -> int:
    """Wait for the program; after a Ctrl-C, make sure it stops within INTERRUPT_STEPS[-1] s."""
    done = 0  # how many escalation steps were taken
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        since = interrupted_at()
        if since is None or done >= len(INTERRUPT_STEPS):
            continue
        if time.monotonic() - since < INTERRUPT_STEPS[done]:
            continue
        if done == 0:
            interrupt_main_thread(proc.pid)
        else:
            sig = signal.SIGTERM if done == 1 else signal.SIGKILL
            print(f"dtf: the program is still running {INTERRUPT_STEPS[done]:g}s after Ctrl-C: "
                  f"sending {sig.name}", file=sys.stderr)
            proc.send_signal(sig)
        done += 1
