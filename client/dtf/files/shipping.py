"""The launcher as dtf ships it: the `dtf_server` package in one zipapp, named by its content;
and beside it, for collective mode's copies only, dtf's own package as a zip (`helpers_bytes`).

Built in memory from the installed package (once per process), deterministically (sorted names,
fixed timestamps), so the same dtf always ships the same bytes under the same name
`launcher-<sha256[:12]>.pyz`. A host may hold launchers of several dtf versions side by side:
a supervisor only ever runs the file it was started from, and a client only the one of its own
version. Uploads are atomic (a temporary name, then a rename: see CommandRunner.put_bytes), so a
supervisor restarting its server never runs a half-written launcher.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import marshal
import os
import zipfile
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

from dtf_server.protocol import Layout

if TYPE_CHECKING:
    from importlib.abc import Traversable

PACKAGE = "dtf_server"
CLIENT_PACKAGE = "dtf"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same bytes on every build


def _sources(package: str) -> list[tuple[str, bytes]]:
    """(path in the zip, content) of every .py file of `package`, its subpackages included, and
    of the sh programs it runs on hosts (package data: dtf.hosts.programs reads them from the zip
    too, on a detached run's host)."""
    found: list[tuple[str, bytes]] = []

    def walk(node: Traversable, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir() and entry.name != "__pycache__":
                walk(entry, f"{prefix}/{entry.name}")
            elif entry.is_file() and entry.name.endswith((".py", ".sh")):
                found.append((f"{prefix}/{entry.name}", entry.read_bytes()))

    walk(resources.files(package), package)
    return found


def _compiled(name: str, source: bytes) -> tuple[str, bytes]:
    """The bytecode of one launcher module, beside its source in the zip (PEP 552: an unchecked
    hash-based pyc, the same bytes on every build). Python cannot write bytecode into a zip, so
    without it every launcher command would compile the launcher anew, most of a command's time
    on a loaded host. A host whose python is another version (another magic number) ignores it
    and compiles the source."""
    code = compile(source, name, "exec", dont_inherit=True)
    header = importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little") + importlib.util.source_hash(source)
    return name + "c", header + marshal.dumps(code)


@functools.cache
def launcher_bytes() -> bytes:
    """The zipapp: `dtf_server`, compiled; kept in the laptop's cache (`launchers/`, named by a
    hash of its sources and of this python's bytecode version): every dtf command names the
    launcher, and building it (compiling it) would slow each command's start.

    The first build to reach the cache is every process's: two processes that build it at the same
    moment make different bytes (marshal's refs and the order of frozenset constants are a
    process's own), and a process names the launcher by its bytes (launcher_name). A build that
    finds the file already there takes that file's bytes, never replaces it: otherwise a `dtf up`
    and a test (or two dtf commands) started at once on a new dtf each named another launcher."""
    server = _sources(PACKAGE)
    return _cached(server + [("__main__.py", _MAIN.encode())], ".pyz", lambda: _build(server))


@functools.cache
def helpers_bytes() -> bytes:
    """dtf's own package as a zip for PYTHONPATH (`import dtf`, `python -m dtf.program.runner`):
    what collective mode's copies of the user's program import on the hosts (helpers_name). Not
    in the launcher, which every `up` sends to every host and which never imports it: it would be
    more than half the launcher's bytes."""
    client = _sources(CLIENT_PACKAGE)
    return _cached(client, ".zip", lambda: _zip(client))


def _cached(sources: list[tuple[str, bytes]], suffix: str, build: Callable[[], bytes]) -> bytes:
    """What `build` makes of `sources`, from the laptop's cache when a build of the same sources
    (and bytecode version) is there (see launcher_bytes), else built and put there. `sources` is
    all the build puts in (the launcher's: its __main__ too, which lives in this file)."""
    key = hashlib.sha256(importlib.util.MAGIC_NUMBER)
    for name, data in sorted(sources):
        key.update(f"{name}\0{len(data)}\0".encode() + data)
    from dtf.files.environment import cache_root

    cached = cache_root() / "launchers" / f"{key.hexdigest()[:24]}{suffix}"
    with contextlib.suppress(OSError):
        return cached.read_bytes()
    data = build()
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, cached)  # whole, and only if no other build is there first
        except FileExistsError:
            data = cached.read_bytes()
        except OSError:  # a file system without hard links: whole, the last build's
            os.replace(tmp, cached)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return data


def _zip(files: list[tuple[str, bytes]], main: str | None = None) -> bytes:
    """A deterministic zip of `files` (sorted, fixed dates); `main`: its top-level __main__.py."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
        if main is not None:
            info = zipfile.ZipInfo("__main__.py", date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            zf.writestr(info, main)
    return buffer.getvalue()


# The zipapp's top-level __main__.py, which python runs (dtf_server.__main__.launch).
_MAIN = "from dtf_server.__main__ import launch\nlaunch()\n"


def _build(server: list[tuple[str, bytes]]) -> bytes:
    return _zip(server + [_compiled(n, data) for n, data in server if n.endswith(".py")], main=_MAIN)


@functools.cache
def launcher_name() -> str:
    return Layout.launcher_name(hashlib.sha256(launcher_bytes()).hexdigest()[:12])


@functools.cache
def helpers_name() -> str:
    return Layout.helpers_name(hashlib.sha256(helpers_bytes()).hexdigest()[:12])
