"""Managed-environment figures on the SSH lab: prints, asserts nothing.

    sudo .venv/bin/python bench/environment.py [--repeat 3] [--cache DIR]

- the laptop's cache: resolving and downloading the wheels for the hosts' platform (a fresh cache
  unless --cache names a filled one)
- a cold `dtf up` on one managed host (/usr/bin/python3: no TensorFlow, no pip), by phase
  (resolve/fetch, send, create, install), against the floor: the same wheels installed by hand
  with uv on a host (`uv venv` + `uv pip install --offline` over ssh), and copying them with scp
- two managed hosts cold: what the laptop sent, what the second host copied from the first
- a warm `up` (the environment is reused) against the same `up` with a python that has TensorFlow
- the environment's size on disk, and the wheels'
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import fmt
from helpers import dtf
from lab import Lab

BARE = "/usr/bin/python3"


def settle() -> None:
    """Write back what earlier steps left dirty, so that a step that writes 1.6 GB is not
    throttled for the one before it (each measured build starts from the same state)."""
    subprocess.run(["sync"], check=False, timeout=300)


def timed(*args: str, home: Path, env: dict[str, str]) -> tuple[float, str]:
    settle()
    t0 = time.monotonic()
    r = dtf(*args, home=home, check=True, timeout=1800, env=env)
    return time.monotonic() - t0, r.stdout


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def ssh(lab: Lab, host: str, command: str, timeout: float = 1800) -> float:
    t0 = time.monotonic()
    subprocess.run(["ssh", "-F", str(lab.ssh_config), "-i", str(lab.key), host, command], check=True,
                   timeout=timeout, capture_output=True)
    return time.monotonic() - t0


def phases(stdout: str, host: str) -> str:
    line = next((x for x in stdout.splitlines() if x.startswith(f"{host}: managed environment")), "")
    return line.split(": ", 2)[-1]


def floor(lab: Lab, host: str, wheels, uv: str, lock: Path) -> tuple[float, float, float]:
    """The same wheels installed by hand with uv on a host: (scp, uv venv, uv pip install) seconds."""
    floor_env = Path(lab.host(host).workdir) / "floor-env"
    copy_dir = Path(lab.host(host).workdir) / "floor-wheels"
    copy_dir.mkdir(parents=True)
    try:
        settle()
        t0 = time.monotonic()
        subprocess.run(["scp", "-q", "-F", str(lab.ssh_config), "-i", str(lab.key), *map(str, wheels.files),
                        f"{host}:{copy_dir}/"], check=True, timeout=1800)
        scp = time.monotonic() - t0
        settle()
        create = ssh(lab, host, f"UV_CACHE_DIR={floor_env}.cache {uv} venv -q --python {BARE} {floor_env}")
        install = ssh(lab, host, f"UV_CACHE_DIR={floor_env}.cache {uv} pip install -q "
                                 f"--python {floor_env}/bin/python --offline --no-index "
                                 f"--find-links {copy_dir} --no-deps --compile-bytecode -r {lock}")
    finally:
        for path in (floor_env, Path(f"{floor_env}.cache"), copy_dir):
            shutil.rmtree(path, ignore_errors=True)
    return scp, create, install


def show_floor(when: str, figures: tuple[float, float, float]) -> None:
    scp, create, install = figures
    print(f"floor ({when}), by hand on a host: scp of the wheels {scp:.1f}s, uv venv {create:.1f}s, "
          f"uv pip install {install:.1f}s: {create + install:.1f}s to build, "
          f"{scp + create + install:.1f}s with the copy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", help="a laptop wheel cache to reuse (default: a fresh one, downloaded)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp, Lab(3, root=Path(tmp) / "lab") as lab:
        home = Path(tmp) / "home"
        cache = Path(args.cache) if args.cache else Path(tmp) / "cache"
        env = {"DTF_CACHE": str(cache)}
        print(f"lab: {len(lab.hosts)} hosts, mode {lab.mode}; host python {BARE}; laptop cache {cache}; "
              f"{os.cpu_count()} cores shared with other work (figures are noisy)")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
        from dtf.files import environment
        from dtf_server.procs import platform_info

        machine, system, libc = platform_info()
        py = subprocess.run([BARE, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                            text=True, check=True).stdout.strip()
        target = environment.Target(machine, system, libc, py)
        t0 = time.monotonic()
        wheels = environment.WheelCache(cache).wheels(environment.requirements("none"), "none", target)
        fetch = time.monotonic() - t0
        print(f"laptop cache: resolve + download for {target.tag} / python {target.py}: {fetch:.1f}s "
              f"({len(wheels.files)} wheels, {wheels.size / 1e6:.0f} MB)")

        lock = Path(tmp) / "lock.txt"
        lock.write_text(wheels.text())
        uv = environment.uv_binary()
        show_floor("before dtf's build", floor(lab, "h1", wheels, uv, lock))

        ports = lab.ports(4)
        managed = {"python": "managed", "base_python": BARE}
        one = lab.inventory(Path(tmp) / "one.yaml",
                            [{"host": "h0", **managed, "ps": [ports[0]], "workers": [ports[1]]}])
        plain = lab.inventory(Path(tmp) / "plain.yaml", [{"host": "h0", "ps": [ports[0]], "workers": [ports[1]]}])
        seconds, out = timed("up", str(one), home=home, env=env)
        print(f"cold dtf up, 1 managed host (2 tasks): {seconds:.1f}s; environment {phases(out, 'h0')}")
        env_dir = next(p for p in Path(lab.host("h0").workdir, ".cache", "env").iterdir() if p.is_dir())
        print(f"environment on disk: {du(env_dir) / 1e9:.2f} GB ({env_dir}); wheels kept on the host: "
              f"{du(Path(lab.host('h0').workdir, '.cache', 'wheels')) / 1e6:.0f} MB")
        timed("down", home=home, env=env)
        show_floor("after dtf's build", floor(lab, "h2", wheels, uv, lock))

        # Two managed hosts, cold: the laptop sends to one, the other copies from it.
        two = lab.inventory(Path(tmp) / "two.yaml", [{"host": "h1", **managed, "ps": [ports[2]]},
                                                     {"host": "h2", **managed, "workers": [ports[3]]}])
        seconds, out = timed("up", str(two), home=home, env=env)
        print(f"cold dtf up, 2 managed hosts: {seconds:.1f}s")
        for host in ("h1", "h2"):
            print(f"  {host}: {phases(out, host)}")
        timed("down", "--purge", home=home, env=env)

        warm: list[float] = []
        user: list[float] = []
        for _ in range(args.repeat):
            warm.append(timed("up", str(one), home=home, env=env)[0])
            timed("down", home=home, env=env)
            user.append(timed("up", str(plain), home=home, env=env)[0])
            timed("down", home=home, env=env)
        print(f"warm dtf up, managed (environment reused): {fmt(warm)}")
        print(f"dtf up, same host with a python that has TensorFlow: {fmt(user)}")
        extra = [w - u for w, u in zip(warm, user)]
        print(f"extra time of a warm managed up: median {sorted(extra)[len(extra) // 2]:+.2f}s")
        timed("up", str(one), home=home, env=env)
        seconds, out = timed("down", "--purge", home=home, env=env)
        purged = re.search(r"h0: cache removed \((\d+) MB freed\)", out)
        print(f"dtf down --purge: {seconds:.1f}s, {purged.group(1) if purged else '?'} MB freed on h0")


if __name__ == "__main__":
    main()
