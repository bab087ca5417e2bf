"""`python -m dtf.notebook.execute NOTEBOOK.ipynb`: how `dtf train` runs a notebook as its program.

As `jupyter nbconvert --execute` would: nbclient runs the code cells in order in a fresh kernel,
in the notebook's directory, and stops at the first cell that raises. The kernel is ipykernel with
dtf's setup done first (dtf.notebook.kernel), in the environment `dtf train` gives a program
(TF_CONFIG, the tunnel's proxy, ...): the notebook's own kernel name is not used, the kernel is
this Python (the one with dtf and the cluster's TensorFlow).

Each cell's output is printed here as it comes (stdout to stdout; stderr, errors to stderr), and
the executed notebook, outputs and all, is saved in the output directory (dtf.output_dir()) under
the notebook's name, also when a cell failed. Exit code 0, or 1 when a cell raised (`dtf train`
then runs it again if a ps was lost: --attempts).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def installed_from() -> tuple[str | None, bool]:
    """(the folder dtf was installed from, whether editably): pip, pipx and uv record a local
    install's folder in direct_url.json (PEP 610); (None, False) where none is recorded."""
    import importlib.metadata
    import urllib.parse
    import urllib.request

    # Every `dtf` distribution on the path: a build's dtf.egg-info in the working directory (a
    # clone's own, on sys.path under `python -m`) records no folder.
    for dist in importlib.metadata.distributions(name="dtf"):
        try:
            recorded = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        url = str(recorded.get("url", ""))
        if url.startswith("file://"):
            folder = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
            return folder, bool((recorded.get("dir_info") or {}).get("editable"))
    return None, False


def notebook_install() -> str:
    """The command that adds the `notebook` extra to the environment this dtf runs in, as the README
    installs dtf from a clone: `pipx install`, `uv tool install`, or pip in a virtual environment.
    `pip install 'dtf[notebook]'` would go to whatever environment `pip` is, and to the package index."""
    import shlex

    folder, editable = installed_from()
    spec = shlex.quote(f"{folder or '.'}[notebook]")
    where = "" if folder else " (in dtf's clone)"
    prefix = Path(sys.prefix)
    homes = {"pipx": [Path(os.environ["PIPX_HOME"]) / "venvs"] if os.environ.get("PIPX_HOME") else [],
             "uv": [Path(os.environ["UV_TOOL_DIR"])] if os.environ.get("UV_TOOL_DIR") else []}
    if prefix.parent in homes["pipx"] or (prefix.parent.name == "venvs" and "pipx" in prefix.parts):
        return f"pipx install --force {spec}{where}"
    if prefix.parent in homes["uv"] or (prefix.parent.name == "tools" and prefix.parent.parent.name == "uv"):
        return f"uv tool install --force {spec}{where}"
    return f"{shlex.quote(sys.executable)} -m pip install {'-e ' if editable else ''}{spec}{where}"


def check_notebook(program: Path, args: list[str], collective: bool = False, wrap: bool = False) -> None:
    """`dtf train NOTEBOOK.ipynb`'s checks, before anything starts: UsageError in one line."""
    import importlib

    from dtf.errors import UsageError

    if args:
        raise UsageError(f"{program}: a notebook takes no arguments (got {' '.join(args)}): "
                         f"set its parameters in a cell")
    if collective or wrap:
        raise UsageError(f"{program}: a notebook runs as the coordinator: "
                         f"{'--collective' if collective else '--wrap'} is for Python scripts")
    missing = []
    for module in ("nbclient", "ipykernel"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UsageError(f"running a notebook needs {' and '.join(missing)}, the notebook extra: {notebook_install()}")
    try:
        json.loads(program.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{program}: not a notebook (not JSON: {e})")


def saved_path(notebook: Path, output: Path) -> Path:
    """Where the executed copy goes: OUTPUT/NAME.ipynb (NAME.executed.ipynb if that is the notebook)."""
    path = output / notebook.name
    return path.with_suffix(".executed.ipynb") if path.resolve() == notebook.resolve() else path


def kernel_spec(where: Path) -> Path:
    """A kernel spec directory (under `where`) for dtf.notebook.kernel on this Python."""
    from dtf.program.runner import python_m

    spec = where / "kernels" / "dtf"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": python_m("dtf.notebook.kernel", "-f", "{connection_file}"),
        "display_name": "dtf", "language": "python", "interrupt_mode": "signal"}))
    return where / "kernels"


def _text(out: dict[str, Any]) -> tuple[str, str]:
    """(stream, text) to print for one output of a cell."""
    kind = out.get("output_type")
    if kind == "stream":
        return str(out.get("name", "stdout")), str(out.get("text", ""))
    if kind == "error":
        lines = out.get("traceback") or [f"{out.get('ename')}: {out.get('evalue')}"]
        return "stderr", ANSI.sub("", "\n".join(lines)) + "\n"
    if kind in ("execute_result", "display_data"):
        plain = out.get("data", {}).get("text/plain")
        return "stdout", (str(plain) + "\n") if plain else ""
    return "stdout", ""


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dtf.notebook.execute NOTEBOOK.ipynb")
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = Path(sys.argv[1]).resolve()
    output = Path(os.environ.get("DTF_OUTPUT_DIR") or "dtf-output").resolve()
    os.environ["DTF_OUTPUT_DIR"] = str(output)  # the kernel runs in the notebook's directory
    output.mkdir(parents=True, exist_ok=True)
    try:
        nb = nbformat.read(notebook, as_version=4)  # type: ignore[no-untyped-call]
    except (OSError, ValueError) as e:
        sys.exit(f"dtf: error: {notebook}: not a notebook ({e})")

    class Streaming(NotebookClient):
        def output(self, outs: Any, msg: Any, display_id: Any, cell_index: int) -> Any:
            out = super().output(outs, msg, display_id, cell_index)
            if out is not None:
                stream, text = _text(out)
                target = sys.stderr if stream == "stderr" else sys.stdout
                target.write(text)
                target.flush()
            return out

    failed: CellExecutionError | None = None
    with tempfile.TemporaryDirectory(prefix="dtf-kernel-") as tmp:
        km = AsyncKernelManager(kernel_name="dtf", kernel_spec_manager=KernelSpecManager(
            kernel_dirs=[str(kernel_spec(Path(tmp)))]))
        client = Streaming(nb, km=km, timeout=None, allow_errors=False,
                           resources={"metadata": {"path": str(notebook.parent)}})
        try:
            client.execute()
        except CellExecutionError as e:
            failed = e
        finally:
            saved = saved_path(notebook, output)
            nbformat.write(nb, saved)  # type: ignore[no-untyped-call]
    if failed is not None:
        cell = next((i for i, c in enumerate(nb.cells) if any(o.get("output_type") == "error"
                                                               for o in c.get("outputs", []))), None)
        where = f"cell {cell + 1}" if cell is not None else "a cell"
        print(f"dtf: {notebook.name}: {where} raised {failed.ename}; the executed notebook is in {saved}",
              file=sys.stderr, flush=True)
        return 1
    print(f"dtf: the executed notebook is in {saved}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
