"""dtf's GPU shares on a machine with NVIDIA GPUs: prints what it finds, asserts nothing.

    PYTHONPATH=client:server python3 bench/gpu_host.py [--gpus N] [--workers W]

For a machine that has GPUs but no TensorFlow (the device machines lent to some sessions have
PyTorch and no network; TensorFlow 2.21 with its CUDA 12 wheels is about 3 GB): `dtf up` of a
local cluster (`connection: local`, 1 ps and W workers, `gpus: N`) with fake servers, then, for
every task the supervisors started, the CUDA_VISIBLE_DEVICES and TF_FORCE_GPU_ALLOW_GROWTH its
server process really has (read from /proc), and the GPUs a CUDA program sees under exactly that
environment (nvidia-smi -L, and PyTorch where it is installed); then `dtf status` and `dtf down`,
and whether any process of the cluster is left. Then collective mode on the same GPUs: a cluster
of W workers, and `dtf train --collective` of a program with no TensorFlow in it that prints, in
each copy, its CUDA_VISIBLE_DEVICES and the GPUs PyTorch sees, and multiplies two matrices on the
first of them (its device, the product's checksum and the rate). dtf's laptop side runs from this
checkout; it needs typer, rich, PyYAML and pathspec.
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


# Each copy's own view of its GPUs: what a Keras program's MirroredStrategy would be given.
COPY = """
import os, time
print("CUDA_VISIBLE_DEVICES=%r" % os.environ.get("CUDA_VISIBLE_DEVICES"))
try:
    import torch
except ImportError:
    raise SystemExit("no torch here")
n = torch.cuda.device_count()
print("torch sees %d GPU(s): %s" % (n, [torch.cuda.get_device_name(i) for i in range(n)]))
if n:
    a = torch.randn(4096, 4096, device="cuda:0")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        b = a @ a
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    print("matmul on %s: checksum %.3e, %.1f TFLOP/s (fp32)" % (b.device, b.float().abs().sum().item(),
                                                               20 * 2 * 4096 ** 3 / took / 1e12))
"""


def collective(tmp: Path, gpus: int, workers: int, env: dict[str, str]) -> None:
    inv = tmp / "collective.yaml"
    inv.write_text(f"cluster: gpuc\nhosts:\n  - host: localhost\n    connection: local\n"
                   f"    workers: {workers}\n    gpus: {gpus}\n    workdir: {tmp}/workc\n")
    program = tmp / "copy_gpus.py"
    program.write_text(COPY)
    if dtf("up", str(inv), env=env).returncode != 0:
        return
    try:
        r = dtf("train", "--cluster", "gpuc", "--collective", str(program), env=env)
        for line in (r.stdout + r.stderr).splitlines():
            if "CUDA_VISIBLE" in line or "torch" in line or "matmul" in line:
                print(f"    copy: {line}")
    finally:
        dtf("down", "--cluster", "gpuc", env=env)


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
        collective(Path(tmp), gpus, args.workers, env)
        left = cluster_processes(Path(tmp))
        print(f"processes of the collective cluster left after down: {len(left)}")


if __name__ == "__main__":
    main()
