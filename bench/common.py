"""What the benchmark scripts share: the test helpers (the SSH lab, running dtf) and the way
figures are printed. The scripts reuse the tests' own code rather than a copy of it."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/lab.py and tests/helpers.py


def ps_and_two_workers(lab: Any) -> list[dict[str, Any]]:
    """The inventory's hosts of a lab of 3: h0 the ps, h1 and h2 a worker each, on ports of their own."""
    ps, w0, w1 = lab.ports(3)
    return [{"host": "h0", "ps": [ps]}, {"host": "h1", "workers": [w0]}, {"host": "h2", "workers": [w1]}]


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):6.2f}s  (min {min(xs):.2f}, max {max(xs):.2f}, n={len(xs)})"


def as_installed() -> None:
    """Run this script again under the python of a user's install, where it runs under this
    checkout's development environment: that holds dtf as an editable install, whose import hook
    (setuptools' finder, for the two source roots client/ and server/) slows every python's
    start: the CLI's and, on the labs, whose hosts run this python, each launcher's and server's.
    No user's laptop or host pays it. The python
    used: a virtual environment of the same interpreter whose one .pth puts the checkout's sources
    and the development environment's packages on sys.path (as a wheel's install does: no hook,
    no other .pth run), kept beside it as .venv/installed. Both sides of a comparison run on it:
    dtf, its hosts, and the floor. An install holds its modules' bytecode (pip compiles them):
    where this environment says not to write it (PYTHONDONTWRITEBYTECODE), each dtf command
    compiled its client's sources again; here bytecode is kept below .venv/installed/pycache
    (PYTHONPYCACHEPREFIX), away from the checkout."""
    if os.environ.get("DTF_BENCH_AS_INSTALLED") or sys.prefix == sys.base_prefix:
        return
    site = sysconfig.get_paths()["purelib"]
    if not any(name.startswith("__editable__.dtf") for name in os.listdir(site)):
        return
    env = Path(sys.prefix) / "installed"
    python = env / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    target = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    Path(target, "dtf-checkout.pth").write_text(f"{REPO / 'client'}\n{REPO / 'server'}\n{site}\n")
    print(f"(running under {python}: dtf as installed, without the editable install's import hook)",
          flush=True)
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    os.execve(str(python), [str(python), *sys.argv],
              {**env_vars, "DTF_BENCH_AS_INSTALLED": "1", "PYTHONPYCACHEPREFIX": str(env / "pycache")})
