"""The layout of client/dtf and server/dtf_server: no import cycle between modules; in the client,
each subpackage imports only the layers below it (what each may import is said in its __init__'s
docstring, and encoded here); on the host side, what the commands use never imports a command's
module; and the client imports of the host side only its contract (protocol, tflog).

Imports are read with `ast`, not by importing: module-level and inside functions (the deferred
ones), under TYPE_CHECKING too, relative and absolute. Importing a module's own ancestor package
is not an edge (Python imports it first anyway); keep the subpackages' __init__ files free of
imports, so that this costs nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "client"
SERVER = ROOT.parent / "server"

# Bottom to top: a group may import itself and the groups before it, and nothing after it.
# `dtf` itself (client/dtf/__init__.py) is the helper API programs import: the program's layer.
LAYERS = [
    ("dtf.errors", {"dtf.errors"}),
    ("dtf.files", {"dtf.files"}),
    ("dtf.cluster", {"dtf.cluster"}),
    ("dtf.hosts", {"dtf.hosts"}),
    ("dtf.providers", {"dtf.providers"}),
    ("dtf.hostops", {"dtf.hostops"}),
    ("dtf.program", {"dtf.program", "dtf", "dtf.notebook"}),
    ("dtf.collective", {"dtf.collective"}),
    ("dtf.detached", {"dtf.detached"}),
    # dtf.detached.coordinator is the host's `dtf train` (a detached run's): a command line too.
    ("the command line", {"dtf.ui", "dtf.top", "dtf.cli", "dtf.__main__", "dtf.detached.coordinator"}),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = f
    return found


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `mods` it imports, anywhere in its file."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != m and not m.startswith(target + "."):
                    edges[m].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    for i, (_, groups) in enumerate(LAYERS):  # a module named in a group is of that group
        if module in groups:
            return i
    for i, (_, groups) in enumerate(LAYERS):
        for g in groups:
            if g != "dtf" and module.startswith(g + "."):
                return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and say so in its docstring)")


# The host side, bottom to top (a module may import its own layer and those before it). Its
# command line imports each command's module by name (dtf_server.commands.RUNS), not with an
# import statement: a command imports its own module only.
SERVER_LAYERS = [
    # What the client imports too: the commands' requests and replies, the layout on a host, and
    # which lines of a log are TensorFlow's (dtf.program.noise builds its filter from them).
    ("the contract", {"dtf_server", "dtf_server.protocol", "dtf_server.tflog"}),
    ("what the commands use", {"dtf_server.procs", "dtf_server.sample", "dtf_server.receive", "dtf_server.envs",
                               "dtf_server.fake", "dtf_server.firewall", "dtf_server.tfserve", "dtf_server.supervisor",
                               "dtf_server.program", "dtf_server.sshkeys"}),
    ("the commands", {"dtf_server.start", "dtf_server.network", "dtf_server.maintenance", "dtf_server.files",
                      "dtf_server.collective", "dtf_server.detached"}),
    ("the command line", {"dtf_server.commands", "dtf_server.__main__"}),
]


def test_no_import_cycle() -> None:
    """In the client, on the host side, and between them (the host side never imports dtf:
    test_the_host_side_never_imports_dtf)."""
    found = cycles(imports({**modules(), **modules(SERVER)}))
    assert not found, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def server_layer_of(module: str) -> int:
    for i, (_, group) in enumerate(SERVER_LAYERS):
        if module in group:
            return i
    raise AssertionError(f"{module} is in no layer: add it to SERVER_LAYERS")


def test_on_the_host_side_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for m, targets in sorted(imports(modules(SERVER)).items()):
        for t in sorted(targets):
            if server_layer_of(t) > server_layer_of(m):
                wrong.append(f"{m} ({SERVER_LAYERS[server_layer_of(m)][0]}) imports {t} "
                             f"({SERVER_LAYERS[server_layer_of(t)][0]})")
    assert not wrong, "lower layers must not import higher ones:\n" + "\n".join(wrong)


def test_the_client_imports_of_the_host_side_only_its_contract() -> None:
    """The client (and the zipapp it builds: dtf.files.shipping finds the package by name) needs of
    dtf_server only what both sides share; the rest is the host's business."""
    contract = SERVER_LAYERS[0][1]
    edges = imports({**modules(), **modules(SERVER)})
    wrong = [f"{m} imports {t}" for m, targets in sorted(edges.items()) if m == "dtf" or m.startswith("dtf.")
             for t in sorted(targets) if t.startswith("dtf_server") and t not in contract]
    assert not wrong, wrong


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for m, targets in sorted(imports(modules()).items()):
        for t in sorted(targets):
            if layer_of(t) > layer_of(m):
                wrong.append(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})")
    assert not wrong, "lower layers must not import higher ones:\n" + "\n".join(wrong)


def test_every_subpackage_says_what_it_owns_and_may_import() -> None:
    for m, f in modules().items():
        if f.name == "__init__.py" and m.count(".") == 1:
            doc = " ".join((ast.get_docstring(ast.parse(f.read_text())) or "").split())
            assert "may import" in doc, f"{f}: its docstring must say what it owns and what it may import"


def test_the_check_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "dtf"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from ..b import y\n")
    (pkg / "b.py").write_text("from dtf.a import x\n")
    (pkg / "c.py").write_text("import dtf.b\n")
    assert cycles(imports(modules(tmp_path))) == [["dtf.a.x", "dtf.b"]]


def test_the_host_side_never_imports_dtf() -> None:
    """dtf_server ships alone to the hosts (standard library and TensorFlow only): dtf may import
    it, never the reverse."""
    server = ROOT.parent / "server"
    wrong = []
    for f in sorted(server.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{f.relative_to(server)}: imports {n}" for n in names if n == "dtf" or n.startswith("dtf.")]
    assert not wrong, wrong


def test_every_test_file_has_a_name_of_its_own() -> None:
    """pytest imports a test file of a folder that is not a package (e2e, fake, slurm) by its
    basename, and refuses a second file of the same name in another such folder: the whole run
    fails at collection."""
    seen: dict[str, list[str]] = {}
    for f in sorted((ROOT.parent / "tests").rglob("test_*.py")):
        if not (f.parent / "__init__.py").exists():
            seen.setdefault(f.name, []).append(str(f.relative_to(ROOT.parent)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
