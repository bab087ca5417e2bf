"""dtf.program.runner runs a program as `python PROGRAM ARGS` would, after dtf's hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_the_program_runs_as_main_with_its_argv_path_and_exit_code(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper_mod.py").write_text("VALUE = 'found next to the program'\n")
    program = tmp_path / "sub" / "prog.py"
    program.write_text(
        "import sys\nimport helper_mod\n"
        "print(__name__, sys.argv, __file__.endswith('prog.py'), helper_mod.VALUE)\n"
        "if __name__ == '__main__':\n    sys.exit(7)\n")
    r = subprocess.run([sys.executable, "-m", "dtf.program.runner", str(program), "a", "--b"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 7, r.stderr
    assert r.stdout == f"__main__ {[str(program), 'a', '--b']} True found next to the program\n"


def test_a_folder_named_dtf_beside_the_program_or_in_the_working_directory_is_not_taken_for_dtf(tmp_path: Path) -> None:
    """`dtf train` run from the folder that holds the clone (a folder `dtf`, no package), of a program
    whose folder holds an empty `dtf` folder: the runner and the program import the installed dtf. Under
    `python -m` the working directory's `dtf` was a namespace package, ahead of an editable install's
    finder: `module 'dtf' has no attribute 'under_dtf'`."""
    from dtf.notebook.execute import kernel_spec
    from dtf.program.runner import python_m
    from dtf.program.train import program_argv

    (tmp_path / "dtf" / "client").mkdir(parents=True)  # the clone, seen from its parent
    app = tmp_path / "app"
    (app / "dtf").mkdir(parents=True)
    program = app / "prog.py"
    program.write_text("import sys\nimport dtf\nprint(dtf.__file__, dtf.under_dtf(), sys.path[0])\n")
    import dtf

    for argv in (program_argv("app/prog.py", []), python_m("dtf.program.runner", str(program))):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (r.returncode, r.stderr) == (0, ""), r.stderr
        assert r.stdout == f"{dtf.__file__} False {app}\n"
    # The other Pythons dtf starts that import dtf: a notebook's run, and its kernel.
    assert program_argv("nb.ipynb", []) == python_m("dtf.notebook.execute", "nb.ipynb")
    spec = json.loads((kernel_spec(tmp_path / "k") / "dtf" / "kernel.json").read_text())
    assert spec["argv"] == python_m("dtf.notebook.kernel", "-f", "{connection_file}")


def test_on_import_runs_after_the_first_import_and_at_once_when_already_imported() -> None:
    code = (
        "import sys\nfrom dtf.program import hooks\nseen = []\n"
        "hooks.on_import('colorsys', lambda m: seen.append(('colorsys', hasattr(m, 'rgb_to_hsv'))))\n"
        "assert seen == []\nimport colorsys\nimport colorsys\n"
        "hooks.on_import('colorsys', lambda m: seen.append('again'))\nprint(seen)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[('colorsys', True), 'again']", r.stderr


def test_the_packing_and_wrap_hooks_import_nothing_until_the_program_imports_tf_keras(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint(sorted(m for m in ('tensorflow', 'tf_keras') if m in sys.modules))\n")
    env = {**os.environ, "DTF_WRAP": "1", "DTF_PACKING": "auto"}
    r = subprocess.run([sys.executable, "-m", "dtf.program.runner", str(program)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[]\n"
    from dtf.program import hooks

    assert {"packing", "wrap"} <= set(hooks.FEATURES)


def test_on_import_survives_a_find_spec_that_imports_nothing() -> None:
    # TensorFlow asks importlib.util.find_spec("tf_keras") before it imports it.
    code = ("import importlib.util\nfrom dtf.program import hooks\nseen = []\n"
            "hooks.on_import('colorsys', lambda m: seen.append('imported'))\n"
            "importlib.util.find_spec('colorsys')\nassert seen == []\nimport colorsys\nprint(seen)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "['imported']", r.stderr


def test_the_exit_status_file_holds_the_code_the_program_ended_with(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("import atexit, sys\natexit.register(print, 'atexit ran')\nexec(sys.argv[1])\n")
    for body, code in [("pass", 0), ("sys.exit(7)", 7), ("sys.exit('message')", 1), ("sys.exit(-1)", 255),
                       ("raise ValueError('x')", 1), ("raise KeyboardInterrupt", None)]:
        status = tmp_path / "status"
        status.unlink(missing_ok=True)
        env = {**os.environ, "DTF_EXIT_STATUS_FILE": str(status)}
        r = subprocess.run([sys.executable, "-m", "dtf.program.runner", str(program), body], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.stdout == "atexit ran\n", (body, r.stderr)
        if code is None:
            assert r.returncode == -2 and not status.exists(), body
        else:
            assert r.returncode == code and status.read_text() == f"{code}\n", (body, r.stderr)


def run_program(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    program = tmp_path / "prog.py"
    program.write_text(text)
    return subprocess.run([sys.executable, "-m", "dtf.program.runner", str(program)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


def test_a_programs_traceback_shows_its_own_frames_not_dtfs(tmp_path: Path) -> None:
    r = run_program(tmp_path, "def inner():\n    raise ValueError('bad value')\n\ninner()\n")
    assert r.returncode == 1
    assert r.stderr.startswith("Traceback (most recent call last):\n"), r.stderr
    assert 'prog.py", line 4, in <module>' in r.stderr and 'prog.py", line 2, in inner' in r.stderr
    assert "runpy" not in r.stderr and "runner.py" not in r.stderr, r.stderr
    assert r.stderr.endswith("ValueError: bad value\n")


def test_ctrl_c_ends_the_program_by_sigint_without_a_traceback(tmp_path: Path) -> None:
    r = run_program(tmp_path, "raise KeyboardInterrupt\n")
    assert r.returncode == -2, r.stderr  # killed by SIGINT, as Python ends on an uncaught Ctrl-C
    assert r.stderr == ""


def test_a_workers_missing_file_is_one_line() -> None:
    from dtf.program.runner import missing_on_worker

    class NotFoundError(Exception):
        __module__ = "tensorflow.python.framework.errors_impl"

    e = NotFoundError("NewRandomAccessFile failed to Create/Open: /home/me/data.csv : No such file or directory\n"
                      "\t [[{{node MultiDeviceIteratorGetNextFromShard}}]] [Op:__inference_train_function_42] "
                      "on /job:worker/replica:0/task:1/device:CPU:0")
    line = missing_on_worker(e)
    assert line is not None and line.startswith("a worker could not open /home/me/data.csv: No such file")
    assert "`dtf sync DIR`" in line and "dtf.synced(NAME)" in line
    assert missing_on_worker(NotFoundError("/tmp/x: No such file or directory")) is None  # here, not a worker's
    assert missing_on_worker(FileNotFoundError("/job:worker x: No such file or directory")) is None
