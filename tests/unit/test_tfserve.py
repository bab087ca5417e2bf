"""The task's server imports only TensorFlow's server module (dtf_server.tfserve): when it may, when
it falls back to `import tensorflow`, and that the lean import leaves out no op a task could run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"

# A stand-in for the tensorflow package: its __init__ marks that it ran (the full import), and its
# server module works in either import (a test may replace or remove any of these files).
FAKE = {
    "tensorflow/__init__.py": "RAN = True\n",
    "tensorflow/python/__init__.py": "",
    "tensorflow/python/tf2.py": "ENABLED = []\ndef enable():\n    ENABLED.append(True)\n",
    "tensorflow/python/training/__init__.py": "",
    "tensorflow/python/training/server_lib.py": "ClusterSpec = Server = object\n",
}

PROBE = textwrap.dedent("""
    import json, sys
    from dtf_server.tfserve import server_lib
    lib, how = server_lib(full=sys.argv[1] == "full")
    package = sys.modules["tensorflow"]
    tf2 = sys.modules.get("tensorflow.python.tf2")
    print(json.dumps({"how": how, "lib": lib.__name__, "init_ran": hasattr(package, "RAN"),
                      "tf2": bool(tf2 and tf2.ENABLED)}))
""")


def probe(site: Path, full: bool = False, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, "full" if full else "lean"], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": f"{SERVER}:{site}", **(env or {})})
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def fake_site(tmp_path: Path, **replace: str | None) -> Path:
    site = tmp_path / "site-packages"  # tensorflow/__init__.py looks for plugins in site-packages dirs
    for name, text in {**FAKE, **replace}.items():
        if text is None:
            continue
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    return site


def test_the_server_module_is_imported_without_tensorflows_init(tmp_path):
    assert probe(fake_site(tmp_path)) == {"how": "lean", "lib": "tensorflow.python.training.server_lib",
                                          "init_ran": False, "tf2": True}


def test_a_layout_without_the_server_module_falls_back_to_the_full_import(tmp_path):
    # The lean import fails; the full import's __init__ may put it in place (here it always exists
    # once __init__ ran, as a TensorFlow that builds its modules at import would).
    site = fake_site(tmp_path, **{
        "tensorflow/__init__.py": "RAN = True\nimport sys, types\n"
                                  "m = types.ModuleType('tensorflow.python.training.server_lib')\n"
                                  "m.ClusterSpec = m.Server = object\n"
                                  "sys.modules[m.__name__] = m\n",
        "tensorflow/python/training/server_lib.py": None})
    assert probe(site) == {"how": "full", "lib": "tensorflow.python.training.server_lib", "init_ran": True,
                           "tf2": False}


def test_what_import_tensorflow_would_load_besides_asks_for_the_full_import(tmp_path):
    """Plugins, first-party kernel libraries, a pluggable device named in the environment (what
    tensorflow/__init__.py loads), and `serve --full`."""
    full = {"how": "full", "lib": "tensorflow.python.training.server_lib", "init_ran": True, "tf2": False}
    site = fake_site(tmp_path)
    assert probe(site, full=True) == full
    assert probe(site, env={"TF_PLUGGABLE_DEVICE_LIBRARY_PATH": str(tmp_path / "libdevice.so")}) == full
    (site / "tensorflow" / "core" / "kernels").mkdir(parents=True)
    assert probe(site) == full
    (site / "tensorflow" / "core" / "kernels").rmdir()
    assert probe(site)["how"] == "lean"
    (site / "tensorflow-plugins").mkdir()
    assert probe(site) == full


OPS = textwrap.dedent("""
    import sys
    if sys.argv[1] == "lean":
        from dtf_server.tfserve import server_lib
        assert server_lib()[1] == "lean"
    else:
        import tensorflow
    from tensorflow.python.client import pywrap_tf_session as c
    from tensorflow.core.framework import op_def_pb2
    ops = op_def_pb2.OpList()
    ops.ParseFromString(c.TF_GetBuffer(c.TF_GetAllOpList()))
    print(" ".join(sorted(op.name for op in ops.op)))
""")


@pytest.mark.tf
def test_the_lean_import_registers_every_op_but_tf_lites_audio_front_end():
    def ops(how: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", OPS, how], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(SERVER)})
        return set(out.stdout.split())

    lean, full = ops("lean"), ops("full")
    assert len(lean) > 1500
    assert full - lean <= {"AudioMicrofrontend"}, sorted(full - lean)
