"""Managed environments, without TensorFlow or network: the inventory keys, what an environment
holds (the CPU or CUDA build of the pinned version), its name, the host's platform, the plan, and
the host side's build (dtf_server.envs) driven by a fake uv."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from dtf.cluster.inventory import loads
from dtf.cluster.plan import Plan, differences, make_plan
from dtf.errors import InventoryError
from dtf.files import environment
from dtf.files.environment import Target
from dtf_server import envs
from dtf_server.protocol import Layout

REPO = Path(__file__).resolve().parents[2]


def parse(text: str):
    return loads(textwrap.dedent(text), "inventory.yaml")


def errors(text: str) -> list[str]:
    with pytest.raises(InventoryError) as info:
        loads(textwrap.dedent(text), "inventory.yaml")
    return info.value.lines()


MANAGED = """\
    cluster: c
    defaults: {python: managed, base_python: /usr/bin/python3}
    hosts:
      - {host: h0, ps: 1}
      - {host: h1, workers: 1, packages: ["pandas==2.2.3", "scipy>=1.13"]}
      - {host: h2, workers: 1, accelerator: cuda}
      - {host: h3, workers: 1, python: /opt/tf/bin/python}
    """


def test_managed_keys_parse_with_defaults():
    inv = parse(MANAGED)
    h0, h1, h2, h3 = inv.hosts
    assert (h0.managed, h0.base_python, h0.packages, h0.accelerator) == (True, "/usr/bin/python3", (), "none")
    assert h1.packages == ("pandas==2.2.3", "scipy>=1.13")
    assert h2.accelerator == "cuda"
    assert not h3.managed and h3.python == "/opt/tf/bin/python"  # defaults' managed keys do not apply


def test_managed_key_errors_point_at_the_key():
    assert errors("""\
        cluster: c
        hosts:
          - {host: h0, ps: 1, workers: 1, packages: pandas}
          - {host: h1, workers: 1, python: managed, packages: ["--index-url=http://x"]}
          - {host: h2, workers: 1, python: managed, accelerator: rocm}
          - {host: h3, workers: 1, accelerator: cuda}
        """) == [
        "inventory.yaml:3:35: hosts[0].packages: expected a list of requirements such as 'pandas==2.2.3' or "
        "'scipy>=1.13', got 'pandas'",
        "inventory.yaml:4:45: hosts[1].packages: expected a list of requirements such as 'pandas==2.2.3' or "
        "'scipy>=1.13', got '--index-url=http://x' in the list",
        "inventory.yaml:5:45: hosts[2].accelerator: expected 'none' or 'cuda', got 'rocm'",
        "inventory.yaml:6:28: hosts[3].accelerator: only for a managed environment (python: managed); "
        "this host's python is 'python3'",
    ]


def test_requirements_cpu_and_cuda_builds_of_one_version():
    v = environment.TF_VERSION
    cpu = environment.requirements("none", ["pandas==2.2.3"])
    assert cpu == (f"tensorflow-cpu=={v}; platform_machine == 'x86_64'", f"tensorflow=={v}; platform_machine != 'x86_64'",
                   f"tf-keras=={v}", f"tensorboard=={v}", "pandas==2.2.3")
    # tf-keras requires `tensorflow`: dropped where tensorflow-cpu is the build (one TensorFlow only).
    assert environment.overrides("none") == (f"tensorflow=={v}; platform_machine != 'x86_64'",)
    cuda = environment.requirements("cuda")
    assert cuda[0] == f"tensorflow[and-cuda]=={v}" and not any("tensorflow-cpu" in r for r in cuda)
    assert environment.overrides("cuda") == (f"tensorflow[and-cuda]=={v}",)


def test_tf_version_matches_the_pyproject_pins():
    pins = dict(re.findall(r'^\s*"([a-z-]+)==([0-9.]+)', (REPO / "pyproject.toml").read_text(), re.M))
    for name in ("tensorflow-cpu", "tensorflow", "tf-keras", "tensorboard"):
        assert pins[name] == environment.TF_VERSION, (name, pins)


def test_env_name_is_a_hash_of_what_it_holds():
    base = environment.env_hash(environment.requirements("none"), "none", "python3")
    assert base == environment.env_hash(environment.requirements("none"), "none", "python3")
    assert len({base, environment.env_hash(environment.requirements("none", ["pandas"]), "none", "python3"),
                environment.env_hash(environment.requirements("cuda"), "cuda", "python3"),
                environment.env_hash(environment.requirements("none"), "none", "/usr/bin/python3")}) == 4


def test_plan_of_a_managed_host_runs_its_tasks_with_the_environment():
    plan = make_plan(parse(MANAGED))
    h0, h1, h2, h3 = plan.hosts
    assert h0.env_dir and h0.env_dir.startswith("~/.dtf/.cache/env/") and h0.python == h0.env_dir + "/bin/python"
    assert h0.tasks[0].serve_argv[0] == h0.python
    assert h0.check_argv()[0] == "/usr/bin/python3"  # the environment may not exist yet
    assert h0.check_argv()[-4:] == ["--env", h0.env_dir, "--wheels", "~/.dtf/.cache/wheels"]
    assert h0.status_argv()[0] == h0.python
    assert h0.purge_argv() == ["/usr/bin/python3", h0.launcher, "purge", "--workdir", "~/.dtf"]
    assert h0.env_dir != h1.env_dir != h2.env_dir  # different contents, different environments
    assert h3.env_dir is None and h3.python == "/opt/tf/bin/python" and "--env" not in h3.check_argv()
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_changed_package_list_is_a_changed_cluster():
    old = make_plan(parse(MANAGED))
    new = make_plan(parse(MANAGED.replace("scipy>=1.13", "scipy>=1.14")))
    assert "host h1: packages ('pandas==2.2.3', 'scipy>=1.13') -> ('pandas==2.2.3', 'scipy>=1.14')" in differences(old, new)


@pytest.mark.parametrize(("target", "platform", "problem"), [
    (Target("x86_64", "Linux", "glibc 2.36", "3.11.2"), "x86_64-manylinux_2_36", None),
    (Target("aarch64", "Linux", "glibc 2.42", "3.12.1"), "aarch64-manylinux_2_40", None),
    (Target("x86_64", "Linux", "", "3.11.2"), None, "managed environments need glibc 2.17 or later; the host has no glibc"),
    (Target("arm64", "Darwin", "", "3.11.2"), None,
     "managed environments need Linux on x86_64 or aarch64; the host is Darwin arm64"),
])
def test_host_platform(target: Target, platform: str | None, problem: str | None):
    assert target.problem() == problem
    if platform:
        assert target.uv_platform == platform


def test_pip_platform_tags_cover_older_manylinux():
    tags = Target("x86_64", "Linux", "glibc 2.36", "3.11.2").pip_platforms()
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert Target("x86_64", "Linux", "glibc 2.36", "3.11.2").key == "cp311-manylinux_2_36_x86_64"


def test_resolution_errors_are_one_line():
    t = Target("x86_64", "Linux", "glibc 2.36", "3.9.2")
    stderr = ("  × No solution found when resolving dependencies:\n  ╰─▶ Because the current Python version (3.9.2) "
              "does not satisfy Python>=3.10 and tensorflow-cpu==2.21.0 depends on Python>=3.10, ...\n")
    assert environment._resolve_error(stderr, "none", t) == "no tensorflow-cpu 2.21.0 wheel for manylinux_2_36_x86_64 / python 3.9"
    other = environment._resolve_error("error: No solution found\n  ╰─▶ Because pandas==99 was not found\n", "none", t)
    assert other.startswith("cannot resolve the packages for manylinux_2_36_x86_64 / python 3.9: ")


# -- the host side: dtf_server.envs with a fake uv --------------------------------------------
FAKE_UV = """\
#!/bin/sh
# a fake uv: `venv DIR` makes DIR/bin/python; `pip install` obeys $FAKE_UV_INSTALL
case "$1" in
  venv) for last; do :; done; mkdir -p "$last/bin" && ln -s "{python}" "$last/bin/python" ;;
  pip) case "$FAKE_UV_INSTALL" in
         full) echo "error: failed to write: No space left on device (os error 28)" >&2; exit 2 ;;
         fail) echo "error: boom" >&2; exit 1 ;;
       esac ;;
esac
"""


@pytest.fixture
def fake_uv(tmp_path: Path) -> Path:
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.replace("{python}", sys.executable))
    uv.chmod(0o755)
    (tmp_path / "req.txt").write_text("tf-keras==2.21.0\n")
    return uv


def test_build_marks_the_environment_complete_last(tmp_path: Path, fake_uv: Path):
    env = str(tmp_path / "env" / "abc")
    assert not envs.ready(env)
    reply = envs.build(env, str(tmp_path), str(fake_uv), str(tmp_path / "req.txt"))
    assert reply.ok and not reply.reused and set(reply.seconds) == {"create", "install"}
    assert envs.ready(env)
    marker = json.loads(Path(env, Layout.ENV_MARKER).read_text())
    assert marker["requirements"] == ["tf-keras==2.21.0"] and marker["python"] == sys.version.split()[0]
    assert envs.build(env, str(tmp_path), str(fake_uv), str(tmp_path / "req.txt")).reused
    assert not Path(env + ".uv-cache").exists()  # uv's cache of one build goes with it


def test_a_half_built_environment_is_never_used_and_is_rebuilt(tmp_path: Path, fake_uv: Path):
    env = tmp_path / "env" / "abc"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    (env / "leftover").write_text("from a build that was killed")
    assert not envs.ready(str(env))  # no marker: not complete
    assert envs.build(str(env), str(tmp_path), str(fake_uv), str(tmp_path / "req.txt")).ok
    assert not (env / "leftover").exists() and envs.ready(str(env))
    # built on another python version: not this one's
    marker = json.loads((env / Layout.ENV_MARKER).read_text())
    (env / Layout.ENV_MARKER).write_text(json.dumps({**marker, "python": "3.9.0"}))
    assert not envs.ready(str(env))


@pytest.mark.parametrize(("mode", "error"), [
    ("full", "disk full while building the environment in {env}"),
    ("fail", "installing the packages failed (exit 1): error: boom"),
])
def test_a_failed_build_is_one_line_and_leaves_nothing(tmp_path: Path, fake_uv: Path, monkeypatch, mode, error):
    monkeypatch.setenv("FAKE_UV_INSTALL", mode)
    env = str(tmp_path / "env" / "abc")
    reply = envs.build(env, str(tmp_path), str(fake_uv), str(tmp_path / "req.txt"))
    assert not reply.ok and reply.error == error.format(env=env)
    assert not os.path.exists(env)


def test_purge_refuses_while_tasks_run_and_removes_the_cache(tmp_path: Path):
    cache = tmp_path / ".cache" / "env" / "abc"
    cache.mkdir(parents=True)
    (cache / "f").write_bytes(b"x" * 10000)
    busy = envs.purge(str(tmp_path), {"demo": ["ps:0"]})
    assert busy.error and "tasks still run" in busy.error and cache.exists()
    done = envs.purge(str(tmp_path), {"demo": []})
    assert done.error is None and done.size >= 10000 and done.removed == [str(tmp_path / ".cache" / "env")]
    assert not (tmp_path / ".cache").exists()


def test_wheels_copied_from_another_host_are_checked(tmp_path: Path):
    """The seed's `serve-wheels` and a peer's `fetch-wheels`, on loopback: only the files named
    are served, each copy is checked against its sha256, and the server stops when idle."""
    import hashlib
    import socket
    import threading

    from dtf.files.relay import Relay

    seed, peer = tmp_path / "seed", tmp_path / "peer"
    seed.mkdir()
    (seed / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 3_000_000)
    (seed / "secret.txt").write_text("not a wheel")
    sha = hashlib.sha256(b"a" * 3_000_000).hexdigest()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served: list = []
    server = threading.Thread(target=lambda: served.append(
        envs.serve(str(seed), port, ["a-1.0-py3-none-any.whl"], idle=1.0, limit=30)))
    server.start()
    url = f"http://127.0.0.1:{port}"
    ok = envs.fetch(url, str(peer), [("a-1.0-py3-none-any.whl", sha)], wait=10, timeout=10)
    assert ok.error is None and ok.fetched == ["a-1.0-py3-none-any.whl"]
    assert (peer / "a-1.0-py3-none-any.whl").read_bytes() == b"a" * 3_000_000
    bad = envs.fetch(url, str(tmp_path / "peer2"), [("a-1.0-py3-none-any.whl", "0" * 64)], wait=10, timeout=10)
    assert bad.fetched == [] and "does not match its sha256" in (bad.error or "")
    denied = envs.fetch(url, str(tmp_path / "peer3"), [("secret.txt", sha)], wait=10, timeout=10)
    assert denied.fetched == [] and "404" in (denied.error or "")
    server.join(timeout=30)
    assert not server.is_alive() and served[0].requests == 3
    assert [p.name for p in (tmp_path / "peer2").iterdir()] == []  # no partial file left

    relay = Relay()  # a tree per target: the first host is its root (the seed), the next copy from it
    first = relay.join("cp311-manylinux_2_36_x86_64", "h0")
    second = relay.join("cp311-manylinux_2_36_x86_64", "h1")
    assert first.host == "h0" and first.parent is None and second.parent is first
    assert relay.join("cp312-manylinux_2_36_x86_64", "h1").parent is None


def test_the_laptops_uv_is_found_once_while_sysconfig_fills_its_variables(monkeypatch: pytest.MonkeyPatch):
    """Two managed hosts ask for the laptop's uv at once. uv's `find_uv_bin` reads
    `sysconfig.get_config_var("EXE")`, and Python 3.11's sysconfig fills its variables on first
    use without a lock: a second thread can read None meanwhile (`"uv" + None`, a TypeError that
    fails `up`). Here sysconfig's filling is held open 0.1 s while eight threads ask."""
    import sysconfig
    import threading
    import time

    fill = sysconfig._init_posix  # type: ignore[attr-defined]

    def slow(variables: dict) -> None:
        time.sleep(0.1)
        fill(variables)

    monkeypatch.setattr(sysconfig, "_init_posix", slow)
    monkeypatch.setattr(sysconfig, "_CONFIG_VARS", None)
    if hasattr(sysconfig, "_CONFIG_VARS_INITIALIZED"):  # Python 3.12+ (which locks it)
        monkeypatch.setattr(sysconfig, "_CONFIG_VARS_INITIALIZED", False)
    monkeypatch.setattr(environment, "_uv", None)
    found: list[object] = []

    def ask() -> None:
        try:
            found.append(environment.uv_binary())
        except Exception as e:  # the failure is the point
            found.append(e)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(found) == 8 and len(set(map(str, found))) == 1, found
    assert os.access(str(found[0]), os.X_OK), found
