"""Managed environments on a host: a Python environment dtf builds with uv from wheels it sent.

    WORKDIR/.cache/env/<hash>/       the environment (Layout.ENV_MARKER in it once complete)
    WORKDIR/.cache/env/<hash>.lock   held (flock) while one is built: two `up`s never build one twice
    WORKDIR/.cache/wheels/           the wheels dtf sent (kept: a rebuild sends nothing again)
    WORKDIR/.cache/bin/uv-<hash>     the uv binary for this host's platform

A half-built environment (a build killed, a full disk) has no marker: the next build removes it
and starts again; nothing ever runs in it. The marker also names the python it was built on: an
environment whose base python changed version is rebuilt too.

Standard library only (this runs before the environment, or TensorFlow, exists).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import time

from dtf_server.procs import read_json, write_json
from dtf_server.protocol import EnvReply, FetchReply, Layout, PurgeReply, ServeReply

LOCK_WAIT = 900.0  # seconds a build waits for another build of the same environment
_NO_SPACE = ("No space left on device", "os error 28", "ENOSPC", "Disk quota exceeded")


def env_python(env: str) -> str:
    return os.path.join(env, "bin", "python")


def ready(env: str) -> bool:
    """Complete (its marker), built on this python's version, and its python is there."""
    marker = read_json(os.path.join(env, Layout.ENV_MARKER))
    return bool(marker and marker.get("python") == _version() and os.path.exists(env_python(env)))


def wheels_in(directory: str | None) -> list[str]:
    if not directory or not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n.endswith(".whl"))


def free_space(path: str) -> int:
    """Bytes free (for this user) on the filesystem `path` is, or would be, created on."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _version() -> str:
    return sys.version.split()[0]


def disk_usage(path: str) -> int:
    """Bytes a tree takes on disk (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class _Failed(Exception):
    pass


def _run(argv: list[str], env: dict[str, str], what: str, target: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _Failed(f"disk full while building the environment in {target}")
        raise _Failed(f"{what}: cannot run {argv[0]}: {e.strerror or e}")
    if proc.returncode != 0:
        text = proc.stderr + proc.stdout
        if any(s in text for s in _NO_SPACE):
            raise _Failed(f"disk full while building the environment in {target}")
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        raise _Failed(f"{what} failed (exit {proc.returncode}): {' | '.join(lines[-3:]) or 'no output'}")


def _lock(path: str, deadline: float) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise _Failed(f"another build of {os.path.dirname(path)} has not finished "
                              f"after {LOCK_WAIT:g}s") from None
            time.sleep(0.2)


def build(env: str, wheels: str, uv: str, requirements: str) -> EnvReply:
    """Build the environment `env` on this python with `uv` from the wheels in `wheels` (no
    index: exactly the pinned `requirements`, a file of `name==version` lines)."""
    try:
        os.makedirs(os.path.dirname(env), exist_ok=True)
        fd = _lock(env + ".lock", time.monotonic() + LOCK_WAIT)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return EnvReply(ok=False, error=f"disk full while building the environment in {env}")
        return EnvReply(ok=False, error=f"cannot create {os.path.dirname(env)}: {e.strerror or e}")
    except _Failed as e:
        return EnvReply(ok=False, error=str(e))
    cache = env + ".uv-cache"  # uv's cache for this build only: the host user's own is not touched
    try:
        if ready(env):
            return EnvReply(ok=True, reused=True, size=disk_usage(env))
        for leftover in (env, cache):  # a build that was killed, or failed
            shutil.rmtree(leftover, ignore_errors=True)
        uv_env = {**os.environ, "UV_CACHE_DIR": cache, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1",
                  "UV_NO_PROGRESS": "1"}
        seconds: dict[str, float] = {}
        t0 = time.monotonic()
        _run([uv, "venv", "--quiet", "--python", sys.executable, "--python-preference", "only-system", env],
             uv_env, "creating the environment", env)
        seconds["create"] = time.monotonic() - t0
        t0 = time.monotonic()
        # --compile-bytecode: once here, not by every server's first import of TensorFlow (two
        # tasks of a host compiling at once can make the first start overrun the start timeout).
        _run([uv, "pip", "install", "--quiet", "--python", env_python(env), "--offline", "--no-index",
              "--find-links", wheels, "--no-deps", "--compile-bytecode", "-r", requirements], uv_env,
             "installing the packages", env)
        seconds["install"] = time.monotonic() - t0
        size = disk_usage(env)
        with open(requirements) as f:
            pinned = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        try:  # last: from here on the environment is complete
            write_json(os.path.join(env, Layout.ENV_MARKER),
                       {"python": _version(), "executable": sys.executable, "requirements": pinned,
                        "size": size, "built": time.time()})
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _Failed(f"disk full while building the environment in {env}")
            raise
        return EnvReply(ok=True, seconds=seconds, size=size)
    except _Failed as e:
        shutil.rmtree(env, ignore_errors=True)  # never used half-built; and the space is needed
        return EnvReply(ok=False, error=str(e))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        os.close(fd)


def purge(workdir: str, running: dict[str, list[str]]) -> PurgeReply:
    """Remove WORKDIR/.cache (environments, wheels, uv, synced trees), unless a cluster's tasks
    run in this workdir (`running`: cluster directory -> its live tasks): they use it."""
    cache = Layout.cache_dir(workdir)
    busy = {name: tasks for name, tasks in running.items() if tasks}
    if busy:
        names = ", ".join(f"{n} ({', '.join(t)})" for n, t in sorted(busy.items()))
        return PurgeReply(removed=[], error=f"not purging {cache}: tasks still run in {workdir}: {names}")
    if not os.path.isdir(cache):
        return PurgeReply(removed=[])
    size = disk_usage(cache)
    removed = [os.path.join(cache, n) for n in sorted(os.listdir(cache))]
    errors: list[str] = []
    shutil.rmtree(cache, onerror=lambda fn, path, exc: errors.append(f"{path}: {exc[1]}"))
    return PurgeReply(removed=removed, size=size, error=errors[0] if errors else None)


# -- wheels from host to host -------------------------------------------------------------------
# The laptop sends a target's wheels to one host (the seed), which serves them on one of its
# planned TF ports (not yet in use) while the other hosts of the cluster copy them: the laptop's
# uplink carries them once, not once per host. Only the files named are served, only for a short
# while (until no request came for `idle` seconds), and each copy is checked against its sha256.


def serve(directory: str, port: int, files: list[str], idle: float, limit: float) -> ServeReply:
    import http.server
    import threading

    allowed = set(files)
    state = {"last": time.monotonic(), "active": 0, "requests": 0, "bytes": 0}
    guard = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            with guard:
                state["active"] += 1
                state["requests"] += 1
            try:
                if name not in allowed:
                    self.send_error(404)
                    return
                path = os.path.join(directory, name)
                self.send_response(200)
                self.send_header("Content-Length", str(os.path.getsize(path)))
                self.end_headers()
                with open(path, "rb") as f:
                    sent = 0
                    while chunk := f.read(1 << 20):
                        self.wfile.write(chunk)
                        sent += len(chunk)
                with guard:
                    state["bytes"] += sent
            except OSError:
                pass  # the client went away: it falls back to the laptop
            finally:
                with guard:
                    state["active"] -= 1
                    state["last"] = time.monotonic()

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    except OSError as e:
        return ServeReply(requests=0, bytes=0, error=f"cannot listen on port {port}: {e.strerror or e}")
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    end = time.monotonic() + limit
    while time.monotonic() < end:
        time.sleep(0.2)
        with guard:
            if state["active"] == 0 and time.monotonic() - state["last"] > idle:
                break
    server.shutdown()
    server.server_close()
    return ServeReply(requests=int(state["requests"]), bytes=int(state["bytes"]))


def fetch(url: str, directory: str, files: list[tuple[str, str]], wait: float, timeout: float) -> FetchReply:
    """Copy each (name, sha256) from `url` into `directory` (a temporary name, checked, renamed);
    the server may take up to `wait` seconds to start listening."""
    import hashlib
    import urllib.error
    import urllib.request

    fetched: list[str] = []
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return FetchReply(fetched=fetched, error=f"cannot create {directory}: {e.strerror or e}")
    start = time.monotonic()
    for name, sha256 in files:
        target = os.path.join(directory, name)  # name: a path below directory (wheels/..., bin/uv-...)
        tmp = f"{target}.tmp-fetch{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        except OSError as e:
            return FetchReply(fetched=fetched, error=f"cannot create {os.path.dirname(target)}: {e.strerror or e}")
        while True:
            try:
                digest = hashlib.sha256()
                with urllib.request.urlopen(f"{url}/{name}", timeout=timeout) as r, open(tmp, "wb") as out:
                    while chunk := r.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                    return FetchReply(fetched=fetched, error=f"disk full while copying the wheels to {directory}")
                refused = "refused" in str(e).lower()
                if not refused or fetched or time.monotonic() - start > wait:
                    return FetchReply(fetched=fetched, error=f"copying {name} from {url} failed: {e}")
                time.sleep(0.3)  # the seed's server is starting
        if digest.hexdigest() != sha256:
            os.unlink(tmp)
            return FetchReply(fetched=fetched, error=f"{name} from {url} does not match its sha256")
        os.replace(tmp, target)
        fetched.append(name)
    return FetchReply(fetched=fetched)
