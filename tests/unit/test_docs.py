"""The documentation cannot drift from the code: checked without MkDocs and without TensorFlow.

- every page in docs/ is in mkdocs.yml's nav, and the nav names no missing page;
- every relative link between the pages (and from the READMEs into docs/) resolves, anchors too;
- every `dtf ...` command line shown is a real command with real options (the Typer app's own);
- the commands page lists every option of every command, with its default;
- every error message the troubleshooting page quotes is worded so in dtf's code, and every
  action of a per-host failure (`ACTION failed on N host(s):`) has its row there;
- every command on the benchmarks page runs a script in bench/ with options it has, and every
  benchmark script has its command there.
- the inventory reference's defaults are the loader's; the JSON documents on the watching page
  have the fields dtf status --json and dtf top --json write.

The strict site build (`make docs`) checks the links again, as MkDocs renders them.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import textwrap
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

import dtf.cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Markdown files outside docs/ whose links and commands are checked too.
OTHERS = [ROOT / "README.md", ROOT / "inventory" / "README.md"]
FILES = PAGES + OTHERS

_FENCE = re.compile(r"^\s*```")
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# `ps -e` names a task's processes `dtf worker:0`: a process name, not a command line.
_PROCESS_NAME = re.compile(r"^(ps|worker):\d+$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose_lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, in code) for every line: code is a rules or an indented block."""
    lines, rules = [], False
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(text):
            rules = not rules
            continue
        lines.append((number, text, rules or text.startswith("    ")))
    return lines


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs' default) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for _, text, code in prose_lines(path):
        m = None if code else _HEADING.match(text)
        if m:
            base = slug(m.group(2))
            name, n = base, 0
            while name in found:  # a repeated heading gets _1, _2 ...
                n += 1
                name = f"{base}_{n}"
            found.add(name)
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, text, code in prose_lines(path):
        if not code:
            out += [(number, m.group(1)) for m in _LINK.finditer(_SPAN.sub("", text))]
    return out


def command_lines(path: Path) -> list[tuple[int, str]]:
    """Every `dtf ...` command shown: a code block's line, or an inline code span."""
    out = []
    for number, text, code in prose_lines(path):
        if code:
            line = text.strip().removeprefix("$ ")
            if line.startswith("dtf "):
                out.append((number, line.split(" #")[0].strip()))
        else:
            out += [(number, m.group(1).strip()) for m in _SPAN.finditer(text) if m.group(1).startswith("dtf ")]
    return out


# ---- the nav -----------------------------------------------------------------------------------
def nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml as data: MkDocs' own tags (`!ENV [NAME, default]`) read as their plain value."""


_ConfigLoader.add_multi_constructor("!", lambda loader, suffix, node: (
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else loader.construct_scalar(node)))


def mkdocs_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_ConfigLoader)
    return config


def test_every_page_is_in_the_nav() -> None:
    """Every Markdown page is in the nav, and every other entry (the example notebook) is a file in docs/."""
    listed = nav_pages(mkdocs_config()["nav"])
    assert sorted(listed) == sorted(set(listed)), "a page is in the nav twice"
    assert {p for p in listed if p.endswith(".md")} == {p.name for p in PAGES}
    assert [p for p in listed if not (DOCS / p).is_file()] == []


def test_the_pages_exist() -> None:
    names = {p.name for p in PAGES}
    assert {"index.md", "getting-started.md", "inventory.md", "troubleshooting.md", "benchmarks.md"} <= names


# ---- the built site, opened from disk (tests/docsite.py runs in `make docs`) -------------------
def test_the_site_check_finds_what_breaks_a_site_opened_from_disk(tmp_path: Path) -> None:
    """docsite.problems, which fails `make docs` after the build, on a small site of each kind of
    link: a folder, a missing file, a file outside the site, an absolute path, a script from
    another host and search without its index as a script are found; plain files, anchors and
    links to other hosts are not."""
    import docsite

    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "a.html").write_text('<a href="../index.html#top">home</a>', encoding="utf-8")
    (tmp_path / "style.css").write_text("", encoding="utf-8")
    (tmp_path / "404.html").write_text('<a href="/index.html">home</a>', encoding="utf-8")  # a server's page
    good = ('<link rel="stylesheet" href="style.css"><link rel="canonical" href="https://example.org/">'
            '<nav><ul><li><a href="guide/a.html">A</a></li><li><a href="#x">here</a></li></ul></nav>'
            '<a href="https://example.org/dtf">repository</a><a href="mailto:x@example.org">mail</a>')
    (tmp_path / "index.html").write_text(good, encoding="utf-8")
    assert docsite.problems(tmp_path) == []
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search_index.json").write_text("{}", encoding="utf-8")
    assert [p.split(":")[0] for p in docsite.problems(tmp_path)] == ["search/search_index.js is missing"]
    (tmp_path / "search" / "search_index.js").write_text("var __index = {}", encoding="utf-8")
    assert docsite.problems(tmp_path) == []

    bad = ('<nav><a href="guide/">folder</a><a href="missing.html">missing</a><img src="/logo.png"></nav>'
           '<a href="../docs/notebook.md">out</a><script src="https://cdn.example.org/x.js"></script>')
    (tmp_path / "index.html").write_text(good + bad, encoding="utf-8")
    assert docsite.problems(tmp_path) == [
        "index.html: <a href='guide/'> is a folder (from disk: a directory listing)",
        "index.html: <a href='missing.html'>: no missing.html in the site",
        "index.html: <img src='/logo.png'>: an absolute path (from disk: the file system's root)",
        "index.html: <a href='../docs/notebook.md'> leaves the site",
        "index.html: <script src='https://cdn.example.org/x.js'> loads from outside the site",
    ]
    (tmp_path / "index.html").write_text('<a href="guide/a.html">not in a nav</a>', encoding="utf-8")
    assert docsite.problems(tmp_path) == ["index.html: no navigation link found (is it still a MkDocs page?)"]


def test_the_example_notebooks_links_to_the_docs_become_the_sites() -> None:
    import docsite

    class Page:
        class file:  # noqa: N801 (MkDocs' page.file)
            src_uri = "example-notebook.ipynb"

    html = '<a href="../docs/notebook.md">a</a> <a href="../docs/training.md#step-packing">b</a> <a href="x.md">c</a>'
    assert docsite.on_page_content(html, Page(), None, None) == (
        '<a href="notebook.html">a</a> <a href="training.html#step-packing">b</a> <a href="x.md">c</a>')


def test_a_shell_block_that_starts_with_a_prompt_is_shown_as_a_terminal_session() -> None:
    """The site's shell blocks are highlighted and wrapped; one starting with `$ ` becomes a
    console block (its output plain, its lines kept whole), the others stay as they are."""
    import docsite

    shell = '<div class="language-shell highlight"><pre><span></span><code>{}</code></pre></div>'
    command = shell.format('dtf<span class="w"> </span>up<span class="w"> </span>lab.yaml')
    session = shell.format('$<span class="w"> </span>dtf<span class="w"> </span>status\ntask  state &lt;x&gt;\nps:0  alive')
    out = docsite.sessions_as_console(f"<p>a</p>{command}<p>b</p>{session}")
    assert out.startswith(f"<p>a</p>{command}<p>b</p>")
    assert out.endswith('<div class="language-console highlight"><pre><span></span><code>'
                        '<span class="gp">$ </span>dtf<span class="w"> </span>status\n'
                        '<span class="go">task  state &lt;x&gt;</span>\n<span class="go">ps:0  alive</span>'
                        '</code></pre></div>')


def test_the_api_page_documents_every_public_helper() -> None:
    """docs/api.md renders each name of dtf.__all__ (`::: dtf.NAME`), and the notebook handle."""
    import dtf

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^::: ([\w.]+)$", text, re.M))
    assert {f"dtf.{name}" for name in dtf.__all__} | {"dtf.notebook.connection.Connection"} <= shown


def test_every_example_is_on_the_site() -> None:
    """docs/examples.md includes every examples/*.py, and the nav's example notebook is
    examples/notebook.ipynb itself (a link to it, not a copy that could drift)."""
    text = (DOCS / "examples.md").read_text(encoding="utf-8")
    included = set(re.findall(r'^--8<-- "(examples/[\w.]+)"$', text, re.M))
    assert included == {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    assert (DOCS / "example-notebook.ipynb").resolve() == (ROOT / "examples" / "notebook.ipynb").resolve()
    assert "example-notebook.ipynb" in nav_pages(mkdocs_config()["nav"])


# ---- links -------------------------------------------------------------------------------------
LINKS = [(path, line, target) for path in FILES for line, target in links(path)
         if not re.match(r"^[a-z]+:", target)]


def test_what_the_extractors_find_on_a_page(tmp_path: Path) -> None:
    """links, command_lines and quoted_messages, on a page of each kind of line: what the tests
    below check is what the pages show (an extractor that found nothing would pass them all)."""
    page = tmp_path / "page.md"
    page.write_text("See [a](a.md#x) and `[not](x.md)`, run `dtf status`.\n"
                    "\n"
                    "```\n"
                    "$ dtf up inventory.yaml  # starts it\n"
                    "[no](code.md)\n"
                    "```\n"
                    "\n"
                    "    dtf down\n"
                    "\n"
                    "| message | meaning |\n"
                    "|---|---|\n"
                    "| `dtf: error: no cluster is up` | run up |\n", encoding="utf-8")
    assert links(page) == [(1, "a.md#x")]
    assert command_lines(page) == [(1, "dtf status"), (4, "dtf up inventory.yaml"), (8, "dtf down")]
    assert quoted_messages(str(page)) == [(12, "dtf: error: no cluster is up")]
    assert LINKS and COMMANDS and MESSAGES  # the pages have each


@pytest.mark.parametrize(("path", "line", "target"), LINKS, ids=[f"{rel(p)}:{n}:{t}" for p, n, t in LINKS])
def test_link_resolves(path: Path, line: int, target: str) -> None:
    file, _, anchor = target.partition("#")
    # normpath, not resolve: a page may be a link to a file elsewhere (the example notebook)
    dest = Path(os.path.normpath(path.parent / file)) if file else path
    assert dest.is_file(), f"{rel(path)}:{line}: {target}: no such file"
    if path.parent == DOCS:
        assert dest.parent == DOCS, f"{rel(path)}:{line}: {target}: a page links only to other pages"
    if anchor:
        assert dest.suffix == ".md", f"{rel(path)}:{line}: {target}: an anchor in a file that is not a page"
        assert anchor in anchors(dest), f"{rel(path)}:{line}: {target}: no heading makes #{anchor}"


# ---- commands ----------------------------------------------------------------------------------
# typer carries its own copy of click: its objects are read by their attributes.
APP: Any = typer.main.get_command(dtf.cli.app)
COMMANDS = [(path, line, text) for path in FILES for line, text in command_lines(path)]


def options_of(command: Any) -> dict[str, Any]:
    return {name: p for p in command.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")}


def check_command_line(text: str) -> str | None:
    """What is wrong with a shown command line, or None. Placeholders and brackets are allowed
    (`dtf up INVENTORY [--dry-run]`); what follows `dtf train`'s PROGRAM is the program's."""
    words = [w.strip("[],").removesuffix("...") for w in text.split()[1:]]
    words = [w for w in words if w]
    if not words:
        return "no command"
    if words[0].startswith("-"):
        top = options_of(APP) | {"--help": APP.params[0]}
        unknown = [w for w in words if w.startswith("-") and w not in top]
        return f"dtf has no option {unknown[0]}" if unknown else None
    if _PROCESS_NAME.match(words[0]):
        return None
    command = APP.commands.get(words[0])
    if command is None:
        return f"no command {words[0]!r} (dtf has {', '.join(APP.commands)})"
    options = options_of(command)
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    positional = 0
    rest = iter(words[1:])
    for word in rest:
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            if name == "--help":
                continue
            param = options.get(name)
            if param is None:
                return f"dtf {command.name} has no option {name}"
            if not (param.is_flag or param.count) and "=" not in word:
                next(rest, None)  # its value
            continue
        positional += 1
        if command.name == "train":  # PROGRAM: what follows is the program's own command line
            return None
        if positional > len(arguments) and not any(a.nargs == -1 for a in arguments):
            return f"dtf {command.name} takes {len(arguments)} argument(s): {word!r} is one too many"
    return None


def test_every_command_is_shown() -> None:
    shown = {text.split()[1] for _, _, text in COMMANDS}
    assert set(APP.commands) <= shown


@pytest.mark.parametrize(("path", "line", "text"), COMMANDS, ids=[f"{rel(p)}:{n}" for p, n, _ in COMMANDS])
def test_command_line_is_real(path: Path, line: int, text: str) -> None:
    problem = check_command_line(text)
    assert problem is None, f"{rel(path)}:{line}: `{text}`: {problem}"


def test_the_check_catches_mistakes() -> None:
    assert check_command_line("dtf up inventory.yaml --dry-run") is None
    assert check_command_line("dtf train --collective [--attempts N] PROGRAM [ARGS...] --epochs 3") is None
    assert check_command_line("dtf logs worker:1 -f -n 20") is None
    assert "no command 'start'" in (check_command_line("dtf start x.yaml") or "")
    assert "has no option --force" in (check_command_line("dtf down --force") or "")
    assert "one too many" in (check_command_line("dtf status extra") or "")
    assert "has no option --no-wrap" in (check_command_line("dtf train --no-wrap prog.py") or "")


def section(page: str, heading: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else len(text)]


@pytest.mark.parametrize("name", list(APP.commands))
def test_commands_page_lists_every_option(name: str) -> None:
    text = section("commands.md", f"## `dtf {name}`")
    missing = [o for o in options_of(APP.commands[name]) if f"`{o}" not in text and f", `{o}`" not in text]
    assert not missing, f"docs/commands.md, dtf {name}: not described: {', '.join(missing)}"


@pytest.mark.parametrize("name", list(APP.commands))
def test_commands_page_gives_every_default(name: str) -> None:
    """Each option's row on the commands page says its default as the CLI has it (10, 600, 3, on)."""
    text = section("commands.md", f"## `dtf {name}`")
    wrong = []
    for param in APP.commands[name].params:
        default = param.default
        if param.param_type_name != "option" or default is None or default is False or isinstance(default, tuple):
            continue
        said = "default on" if default is True else f"{default:g}" if isinstance(default, float) else str(default)
        rows = [line for line in text.splitlines() if line.startswith(f"| `{param.opts[0]}")]
        if not any(said in row for row in rows):
            wrong.append(f"{param.opts[0]} (default {default!r})")
    assert not wrong, f"docs/commands.md, dtf {name}: the default not said: {', '.join(wrong)}"


# ---- the messages quoted on the troubleshooting page -------------------------------------------
def code_text() -> str:
    """The text of dtf's sources, each implicit string concatenation joined into one literal and
    backticks dropped (a table cell's code span cannot hold them)."""
    texts = []
    for path in sorted([*(ROOT / "client").rglob("*.py"), *(ROOT / "server").rglob("*.py"),
                        *(ROOT / "client").rglob("*.sh")]):
        text = path.read_text(encoding="utf-8")
        texts.append(re.sub(r"([\"'])\s*\n\s*[rbfRBF]*([\"'])", "", text).replace("`", ""))
    return "\n".join(texts)


# Quoted messages whose longest run of words is not one literal in dtf's code: another program's
# words (PyYAML's), or words dtf puts together from parts (a list, a hint).
NOT_ONE_LITERAL = {
    "that cannot start any token",  # PyYAML's scanner
    "expected a host name without quotes or shell characters",  # values.name_reader: what + flaw
    "expected one of auto",  # cli: the modes joined
    "expected a mapping with keys cluster and hosts",  # inventory.checks: "the file is empty; expected " + what
    "expected a list of requirements such as",  # inventory.values: "expected " + what a list holds
}


def quoted_messages(page: str) -> list[tuple[int, str]]:
    """The code spans in the first column of the page's tables: the messages it quotes."""
    out = []
    for number, text, code in prose_lines(DOCS / page):
        if not code and text.startswith("| ") and not text.startswith(("| message", "| code", "|---")):
            out += [(number, m.group(1)) for m in _SPAN.finditer(text.split(" | ")[0])]
    return out


def words_of(message: str) -> str | None:
    """The longest run of two or more plain lowercase words in `message`, None if it has none.
    Placeholders (CAPITALS), example values with digits (h1, 2222) and dotted or indexed names
    (hosts[0].ps, dtf.synced) end a run."""
    message = re.sub(r"\b[a-z_]+(\[[^\]]*\]|\.[a-z_]+)+|\b\w*\d\w*\b", "#", message)
    runs = [r.strip() for r in re.split(r"[^a-z ]+", message)]
    runs = [r for r in runs if len(r.split()) >= 2]
    return max(runs, key=len) if runs else None


MESSAGES = quoted_messages("troubleshooting.md")


def test_every_quoted_message_is_in_the_code() -> None:
    code = code_text()
    missing = [f"docs/troubleshooting.md:{n}: `{m}`: no {w!r} in client/ or server/"
               for n, m in MESSAGES if (w := words_of(m)) and w not in NOT_ONE_LITERAL and w not in code]
    assert not missing, "\n".join(missing)


def host_failure_actions() -> set[str]:
    """The ACTION of every `ACTION failed on N host(s):` dtf raises (errors.HostFailure)."""
    return set(re.findall(r"HostFailure\(\s*\"([^\"]+)\"", code_text()))


def test_every_host_failure_action_is_on_the_troubleshooting_page() -> None:
    actions = host_failure_actions()
    assert {"dtf up", "dtf down", "sending the program"} <= actions  # the search finds them
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = sorted(a for a in actions if f"*{a}*" not in page)
    assert not missing, f"docs/troubleshooting.md: no row for the action(s) {missing}"


# ---- the benchmarks page -----------------------------------------------------------------------
_BENCH_COMMAND = re.compile(r"\bbench/(\w+\.py)((?:\s+\S+)*)")
# bench/ modules that are no benchmark of their own: helpers the scripts import or run.
BENCH_HELPERS = {"common.py", "cpugroups.py", "delay_relay.py"}


def bench_commands() -> list[tuple[int, str, list[str]]]:
    """(line, script, options) of every command line the benchmarks page shows."""
    out = []
    for number, text, code in prose_lines(DOCS / "benchmarks.md"):
        m = _BENCH_COMMAND.search(text) if code and "python" in text else None
        if m:
            out.append((number, m.group(1), [w.split("=")[0] for w in m.group(2).split() if w.startswith("-")]))
    return out


def test_every_benchmark_command_is_a_real_script_and_options() -> None:
    commands = bench_commands()
    assert len(commands) >= 15
    problems = []
    for number, script, options in commands:
        path = ROOT / "bench" / script
        if not path.is_file():
            problems.append(f"docs/benchmarks.md:{number}: no bench/{script}")
            continue
        source = path.read_text(encoding="utf-8")
        problems += [f"docs/benchmarks.md:{number}: bench/{script} has no option {o}"
                     for o in options if f'"{o}"' not in source]
    shown = {script for _, script, _ in commands}
    problems += [f"docs/benchmarks.md: no command for bench/{p.name}"
                 for p in sorted((ROOT / "bench").glob("*.py")) if p.name not in shown | BENCH_HELPERS]
    assert not problems, "\n".join(problems)


# ---- the JSON documents on the watching page ---------------------------------------------------
def json_examples(page: str) -> list[dict[str, Any]]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return [json.loads(block) for block in re.findall(r"^```json\n(.*?)^```", text, re.S | re.M)]


def keys_of_dict_assigned(module: Any, function: str, name: str) -> set[str]:
    """The keys of the dict literal `function` (in `module`) assigns to `name`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(module, function))))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{module.__name__}.{function} assigns no dict to {name}")


def test_the_json_documents_shown_have_every_field_the_code_writes(tmp_path: Path) -> None:
    """docs/watching.md's `dtf status --json` (and its Slurm part) and `dtf top --json`, field for
    field against what dtf.ui and dtf.top build."""
    from dtf import top, ui
    from dtf.cluster.inventory import loads
    from dtf.cluster.plan import make_plan
    from dtf.hostops.status import TaskState
    from dtf.program import figures

    status, slurm_status, top_doc = json_examples("watching.md")
    plan = make_plan(loads("cluster: c\nhosts: [{host: h, ps: 1, workers: 1}]\n", "i.yaml"),
                     resolve=lambda spec: spec.host, server="fake")
    rows = ui.status_rows([TaskState(task, "alive", None, None) for task in plan.tasks()])
    assert set(status) == {"schema", "cluster", "network", "firewall", "tasks", "training"}
    assert set(status["tasks"][0]) == set(rows[0])
    assert set(slurm_status) == set(status) | {"slurm"}
    from dtf.providers.slurm.provider import SlurmProvider

    assert set(slurm_status["slurm"]) == keys_of_dict_assigned(SlurmProvider, "report", "doc")

    live = tmp_path / "live"
    live.mkdir()
    figures.write_atomic(live / figures.RUN, {"schema": 1, "kind": "ps", "pid": os.getpid()})
    figures.write_atomic(live / figures.TRAIN, {"schema": 1, "pid": os.getpid()})
    train = top.training(live)
    assert train is not None
    doc = top.snapshot(plan, {}, train)
    assert set(top_doc) == set(doc)
    assert set(top_doc["summary"]) == set(doc["summary"])
    assert set(top_doc["tasks"][0]) == set(doc["tasks"][0])
    assert set(top_doc["training"]) == set(train)
    program = figures.Figures(live / figures.TRAIN)
    program.closure_done(0, 1)
    assert set(top_doc["training"]["workers"]["0"]) == set(program.snapshot()["workers"]["0"])


# ---- the inventory reference's defaults --------------------------------------------------------
def test_the_inventory_reference_gives_the_loaders_defaults() -> None:
    """Each host key's default in docs/inventory.md's table is what the loader gives a host that
    leaves the key out, and the top-level defaults are the loader's too."""
    from dtf.cluster.inventory import loads

    inventory = loads("cluster: c\nhosts: [{host: h, ps: 1, workers: 1}]\n", "i.yaml")
    host = inventory.hosts[0]
    table = section("inventory.md", "## Host keys")
    shown = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` +\| [^|]+\| `([^`]*)` +\|", table, re.M)}
    keys = ("connection", "python", "base_python", "accelerator", "workdir", "restart_limit", "restart_backoff")
    assert {k: shown.get(k) for k in keys} == {k: str(getattr(host, k)) for k in keys}
    assert (shown.get("packages"), host.packages) == ("[]", ())
    assert shown.get("tf_port") == str(host.ps_ports[0])  # counts start at tf_port
    top = section("inventory.md", "## Top-level keys")
    assert f"default {inventory.host_timeout:g})" in top and f"default `{inventory.network}`" in top
    assert f"`{inventory.firewall}` (default)" in top


def test_every_markdown_file_the_code_and_examples_cite_is_in_the_repository() -> None:
    """examples/, client/, server/ and bench/ cite documents by path (`docs/watching.md`): each is in
    the repository."""
    cited = {(path, name) for tree in ("examples", "client", "server", "bench") for path in (ROOT / tree).rglob("*")
             if path.is_file() and path.suffix in (".py", ".md", ".ipynb", ".sh")
             for name in re.findall(r"[\w./-]+\.md\b", path.read_text(errors="replace"))}
    assert cited
    missing = [(str(path.relative_to(ROOT)), name) for path, name in sorted(cited)
               if not (path.parent / name).exists() and not (ROOT / name).exists()]
    assert missing == []
