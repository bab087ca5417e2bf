"""dtf's GPU shares on a machine with NVIDIA GPUs: prints what it finds, asserts nothing.

    PYTHONPATH=client:server python3 bench/gpu_host.py [--gpus N] [--workers W]

For a machine that has GPUs but no TensorFlow (the device machines lent to some sessions have
PyTorch and no network; TensorFlow 2.21 with its CUDA 12 wheels is about 3 GB): `dtf up` of a
local cluster (`connection: local`, 1 ps and W workers, `gpus: N`) with fake servers, then, for
every task the supervisors started, the CUDA_VISIBLE_DEVICES and TF_FORCE_GPU_ALLOW_GROWTH its
server process really has (read from /proc), and the GPUs a CUDA program sees under exactly that
environment (nvidia-smi -L, and PyTorch where it is installed); then `dtf status` and `dtf down`,
and whether any process of the cluster is left. dtf's laptop side runs from this checkout; it
needs typer, rich, PyYAML and pathspec.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dtf(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dtf.cli", *args], env=env, capture_output=True, text=True,
                       timeout=120)
    print(f"$ dtf {' '.join(args)}  (exit {r.returncode}, {time.monotonic() - t0:.2f}s)")
    for line in (r.stdout + r.stderr).strip().splitlines()[-12:]:
        print(f"    {line}")
    return r


def cluster_processes(home: Path) -> dict[int, tuple[str, dict[str, str]]]:
    """pid -> (command line, environment) of every process whose command line names `home`."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(home) not in cmd:
                continue
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(v.decode(errors="replace").split("=", 1) for v in raw if b"=" in v)
        found[int(pid)] = (cmd, env)
    return found


def seen_gpus(env: dict[str, str]) -> str:
    """The GPUs a CUDA program sees under `env`'s CUDA_VISIBLE_DEVICES (or its absence)."""
    child = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if "CUDA_VISIBLE_DEVICES" in env:
        child["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    probe = ("import torch; n = torch.cuda.device_count(); "
             "print(n, [torch.cuda.get_device_name(i) for i in range(n)])")
    r = subprocess.run([sys.executable, "-c", probe], env=child, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"no torch: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return f"torch sees {r.stdout.strip()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=None, help="the host's gpus: (default: nvidia-smi's count)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError as e:
        smi = ""
        print(f"nvidia-smi: {e}")
    print(f"nvidia-smi -L: {smi}")
    gpus = args.gpus if args.gpus is not None else max(1, len(smi.splitlines()))
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        inv = Path(tmp) / "gpu.yaml"
        inv.write_text(f"cluster: gpu\nhosts:\n  - host: localhost\n    connection: local\n    ps: 1\n"
                       f"    workers: {args.workers}\n    gpus: {gpus}\n    workdir: {tmp}/work\n")
        # TensorFlow's metadata alone, as the tests' fakes: `up` checks that the host's python
        # has TensorFlow, and the fake servers never import it.
        meta = Path(tmp) / "tfmeta" / "tensorflow_cpu-2.21.0.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorflow-cpu\nVersion: 2.21.0\n")
        env = {**os.environ, "DTF_HOME": str(home), "DTF_SERVER": "fake",
               "PYTHONPATH": os.pathsep.join([str(REPO / "client"), str(REPO / "server"), str(meta.parent),
                                              *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        dtf("up", "--dry-run", str(inv), env=env)
        if dtf("up", str(inv), env=env).returncode != 0:
            sys.exit(1)
        try:
            for pid, (cmd, penv) in sorted(cluster_processes(Path(tmp)).items()):
                if " serve" not in cmd and " fake" not in cmd:
                    continue
                words = cmd.split()
                task = (f"{words[words.index('--job') + 1]}:{words[words.index('--index') + 1]}"
                        if "--job" in words and "--index" in words else cmd[-60:])
                visible = penv.get("CUDA_VISIBLE_DEVICES", "(unset)")
                growth = penv.get("TF_FORCE_GPU_ALLOW_GROWTH", "(unset)")
                print(f"task process {pid} ({task}): CUDA_VISIBLE_DEVICES={visible!r} "
                      f"TF_FORCE_GPU_ALLOW_GROWTH={growth!r}; "
                      f"{seen_gpus(penv)}")
            dtf("status", env=env)
        finally:
            dtf("down", env=env)
        left = cluster_processes(Path(tmp))
        print(f"processes of the cluster left after down: {len(left)}")


if __name__ == "__main__":
    main()
