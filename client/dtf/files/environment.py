"""Managed environments (`python: managed`): what goes in a host's environment, and the laptop's
cache of the wheels that build it.

A managed host needs only a `python3`. dtf resolves the laptop's pinned TensorFlow, tf-keras and
tensorboard plus the inventory's `packages` for the host's platform and python (uv's resolver
with a target platform), downloads those wheels once into the laptop's cache (`pip download`
for that platform: uv has no download command), sends them, and builds the environment on the
host with uv (dtf_server.envs). The hosts need no package index.

The environment is named by a hash of what was asked for (requirements, accelerator, base
python), so the plan knows its python before anything runs; the pinned set a build resolved is
recorded in it.

    DTF_CACHE (default ~/.cache/dtf)
        locks/<hash>.txt                 the pinned set for one request and target
        wheels/<target>/*.whl            the wheels of a target (cp311-manylinux_2_36_x86_64)
        uv/<version>-<machine>/uv        uv for a host whose platform differs from this machine's

Heavy work (network, subprocesses) happens only in `WheelCache`; the rest is pure.
"""

from __future__ import annotations

import hashlib
import os
import platform
import posixpath
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dtf_server.protocol import Layout

# Keep equal to pyproject.toml's pins (tests/unit/test_environment.py checks).
TF_VERSION = "2.21.0"
CACHE_ENV = "DTF_CACHE"
RESOLVE_TIMEOUT = 300.0  # seconds for one resolution, or one download of a target's wheels
MIN_GLIBC, MAX_GLIBC = 17, 40  # manylinux_2_17 .. what uv's --python-platform names


class EnvError(Exception):
    """A managed environment cannot be prepared for a host: one line saying why."""


def tf_package(accelerator: str) -> str:
    return "tensorflow[and-cuda]" if accelerator == "cuda" else "tensorflow-cpu"


def requirements(accelerator: str, packages: Sequence[str] = ()) -> tuple[str, ...]:
    """What a managed environment asks for. tensorflow-cpu has x86_64 wheels only; elsewhere
    the plain tensorflow build is the CPU one. The same version either way."""
    v = TF_VERSION
    if accelerator == "cuda":
        tf = [f"tensorflow[and-cuda]=={v}"]
    else:
        tf = [f"tensorflow-cpu=={v}; platform_machine == 'x86_64'",
              f"tensorflow=={v}; platform_machine != 'x86_64'"]
    return (*tf, f"tf-keras=={v}", f"tensorboard=={v}", *packages)


def overrides(accelerator: str) -> tuple[str, ...]:
    """tf-keras and tensorboard require `tensorflow`: where tensorflow-cpu is the build, that
    requirement is dropped (a marker never true there), or the environment would hold both."""
    if accelerator == "cuda":
        return (f"tensorflow[and-cuda]=={TF_VERSION}",)
    return (f"tensorflow=={TF_VERSION}; platform_machine != 'x86_64'",)


def env_hash(reqs: Sequence[str], accelerator: str, base_python: str) -> str:
    text = "\n".join(["dtf-env-1", accelerator, base_python, *reqs, *overrides(accelerator)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def env_dir(workdir: str, digest: str) -> str:
    return posixpath.join(Layout.cache_dir(workdir, "env"), digest)


def wheels_dir(workdir: str) -> str:
    return Layout.cache_dir(workdir, "wheels")


def uv_name(binary: Path) -> str:
    """uv's name on a host (WORKDIR/.cache/bin/): by its content, so another version never clashes."""
    return f"uv-{hashlib.sha256(binary.read_bytes()).hexdigest()[:12]}"


# -- the host's platform ---------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A host's platform as its `check` reported it."""

    machine: str  # x86_64, aarch64
    system: str  # Linux
    libc: str  # "glibc 2.36"
    python: str  # "3.11.2"

    @property
    def py(self) -> str:
        return ".".join(self.python.split(".")[:2])

    @property
    def glibc_minor(self) -> int:
        m = re.fullmatch(r"glibc 2\.(\d+)", self.libc)
        return int(m.group(1)) if m else 0

    def problem(self) -> str | None:
        """Why no managed environment can be built there (None: it can)."""
        if self.system != "Linux" or self.machine not in ("x86_64", "aarch64"):
            return (f"managed environments need Linux on x86_64 or aarch64; the host is "
                    f"{self.system} {self.machine}")
        if self.glibc_minor < MIN_GLIBC:
            return f"managed environments need glibc 2.{MIN_GLIBC} or later; the host has {self.libc or 'no glibc'}"
        return None

    @property
    def uv_platform(self) -> str:
        """uv's --python-platform: e.g. x86_64-manylinux_2_36 (uv names up to 2_40)."""
        return f"{self.machine}-manylinux_2_{min(self.glibc_minor, MAX_GLIBC)}"

    @property
    def tag(self) -> str:
        return f"manylinux_2_{self.glibc_minor}_{self.machine}"

    @property
    def key(self) -> str:
        return f"cp{self.py.replace('.', '')}-{self.tag}"

    def pip_platforms(self) -> list[str]:
        """Every platform tag a wheel for this host may carry (pip download --platform does not
        infer older manylinux versions)."""
        tags = [f"manylinux_2_{m}_{self.machine}" for m in range(self.glibc_minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{self.machine}" for m, name in legacy.items() if m <= self.glibc_minor]


# -- the laptop's cache ----------------------------------------------------------------------
def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dtf"


_UV_LOCK = threading.Lock()
_uv: str | None = None


def uv_binary() -> str:
    """The laptop's uv (the `uv` package, a dependency of dtf), found once per process.

    Found under a lock: `find_uv_bin` reads `sysconfig.get_config_var("EXE")`, and Python 3.11's
    sysconfig fills its variables on first use without a lock, so a second thread reads None
    meanwhile: two managed hosts asking at once would fail `up` with `TypeError: can only
    concatenate str (not "NoneType") to str` (tests/unit/test_environment.py holds the race open)."""
    global _uv
    with _UV_LOCK:
        if _uv is None:
            try:
                from uv import find_uv_bin

                _uv = str(find_uv_bin())
            except (ImportError, FileNotFoundError):
                found = shutil.which("uv")
                if found is None:
                    raise EnvError("uv is not installed on this machine (pip install uv)") from None
                _uv = found
        return _uv


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class WheelSet:
    """The pinned set for one request and target, and the wheel files on the laptop."""

    pinned: tuple[str, ...]  # name==version lines
    files: tuple[Path, ...]

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def text(self) -> str:
        return "".join(f"{line}\n" for line in self.pinned)


class WheelCache:
    """The laptop's cache: pinned sets and wheels per target, fetched once. Thread-safe: hosts
    of one target wait for the one download."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_root()
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._digests: dict[Path, str] = {}

    def sha256(self, files: Sequence[Path]) -> dict[Path, str]:
        """Each file's sha256 (remembered: the same wheel is asked for by every host)."""
        out = {}
        for f in files:
            with self._guard:
                known = self._digests.get(f)
            if known is None:
                digest = hashlib.sha256()
                with open(f, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        digest.update(chunk)
                known = digest.hexdigest()
                with self._guard:
                    self._digests[f] = known
            out[f] = known
        return out

    def _lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def wheels(self, reqs: Sequence[str], accelerator: str, target: Target) -> WheelSet:
        with self._lock(target.key):
            pinned = self._resolve(reqs, accelerator, target)
            return WheelSet(pinned, tuple(self._download(pinned, target)))

    def _resolve(self, reqs: Sequence[str], accelerator: str, target: Target) -> tuple[str, ...]:
        text = "\n".join([target.key, *reqs, "--", *overrides(accelerator)])
        lock = self.root / "locks" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.txt"
        if lock.exists():
            return tuple(lock.read_text().split())
        lock.parent.mkdir(parents=True, exist_ok=True)
        work = lock.with_suffix(f".in-{os.getpid()}-{threading.get_ident()}")
        work.mkdir(parents=True, exist_ok=True)
        try:
            (work / "requirements.in").write_text("\n".join(reqs) + "\n")
            (work / "overrides.txt").write_text("\n".join(overrides(accelerator)) + "\n")
            argv = [uv_binary(), "pip", "compile", "--quiet", "--no-header", "--no-annotate",
                    "--python-platform", target.uv_platform, "--python-version", target.py,
                    "--override", str(work / "overrides.txt"), str(work / "requirements.in")]
            r = _run(argv, "resolving the packages")
            if r.returncode != 0:
                raise EnvError(_resolve_error(r.stderr, accelerator, target))
            pinned = tuple(line.split(";")[0].strip() for line in r.stdout.splitlines()
                           if line.strip() and not line.lstrip().startswith("#"))
            tmp = lock.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text("".join(f"{p}\n" for p in pinned))
            os.replace(tmp, lock)
            return pinned
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _download(self, pinned: Sequence[str], target: Target) -> list[Path]:
        directory = self.root / "wheels" / target.key
        directory.mkdir(parents=True, exist_ok=True)
        found = {p: _find_wheel(directory, p) for p in pinned}
        missing = [p for p, f in found.items() if f is None]
        if missing:
            tmp = directory / f".download-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                platforms = [a for tag in target.pip_platforms() for a in ("--platform", tag)]
                argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "--python-version", target.py, "--implementation", "cp",
                        *platforms, "--dest", str(tmp), *missing]
                r = _run(argv, "downloading the wheels")
                if r.returncode != 0:
                    lines = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.splitlines()
                    raise EnvError(f"downloading the wheels for {target.tag} / python {target.py} failed: "
                                   f"{(lines or ['no output'])[0].removeprefix('ERROR: ')}")
                for f in tmp.glob("*.whl"):
                    os.replace(f, directory / f.name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            found = {p: _find_wheel(directory, p) for p in pinned}
        lost = [p for p, f in found.items() if f is None]
        if lost:
            raise EnvError(f"no wheel for {', '.join(lost)} on {target.tag} / python {target.py}")
        return [f for f in found.values() if f is not None]

    def uv_for(self, target: Target) -> Path:
        """A uv binary for the host: this machine's when the platforms match, else uv's wheel for
        the host's machine, downloaded once and unpacked."""
        mine = Path(uv_binary())
        if platform.system() == "Linux" and platform.machine() == target.machine:
            return mine
        from importlib.metadata import version

        uv_version = version("uv")
        binary = self.root / "uv" / f"{uv_version}-{target.machine}" / "uv"
        with self._lock(f"uv-{target.machine}"):
            if binary.exists():
                return binary
            tmp = binary.parent / f".download-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--platform", f"manylinux_2_17_{target.machine}", "--platform",
                        f"manylinux2014_{target.machine}", "--dest", str(tmp), f"uv=={uv_version}"]
                r = _run(argv, "downloading uv")
                wheel = next(iter(tmp.glob("*.whl")), None)
                if r.returncode != 0 or wheel is None:
                    raise EnvError(f"cannot download uv {uv_version} for {target.machine}: "
                                   f"{(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
                with zipfile.ZipFile(wheel) as zf:
                    member = next(n for n in zf.namelist() if n.endswith(".data/scripts/uv"))
                    binary.parent.mkdir(parents=True, exist_ok=True)
                    part = binary.with_suffix(".part")
                    part.write_bytes(zf.read(member))
                    part.chmod(0o755)
                    os.replace(part, binary)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return binary


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EnvError(f"{what} took longer than {RESOLVE_TIMEOUT:g}s (is the package index reachable?)")
    except OSError as e:
        raise EnvError(f"{what}: cannot run {argv[0]}: {e.strerror or e}")


def _find_wheel(directory: Path, pin: str) -> Path | None:
    name, _, version = pin.partition("==")
    for f in directory.glob("*.whl"):
        parts = f.name.split("-")
        if len(parts) >= 5 and _canonical(parts[0]) == _canonical(name) and parts[1] == version:
            return f
    return None


def _resolve_error(stderr: str, accelerator: str, target: Target) -> str:
    """uv's explanation, as one line: the TensorFlow build missing for the platform named so."""
    text = " ".join(stderr.split())
    tf = tf_package(accelerator).split("[")[0]
    if re.search(r"\btensorflow(-cpu)?\b", text) and ("matching platform tag" in text or "Python" in text
                                                      or "no version" in text.lower()):
        return f"no {tf} {TF_VERSION} wheel for {target.tag} / python {target.py}"
    if any(s in text for s in ("Failed to fetch", "dns error", "connect", "timed out")):
        return f"cannot reach the package index to resolve the packages: {text[:300]}"
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    cause = next((x for x in lines if x.startswith(("cause:", "╰─▶", "Because"))), lines[-1] if lines else "")
    return f"cannot resolve the packages for {target.tag} / python {target.py}: {cause[:300]}"
