"""MkDocs hooks of the documentation site (mkdocs.yml `hooks:`), and the check of the built site.

The site must work opened from disk (file://.../build/site/index.html), where a link is a file
and nothing is fetched: a link to a folder shows a directory listing, and a script or stylesheet
from another host is missing without a network. After every build, `problems` reads each page of
the site and the build fails (`make docs`) on a relative link, script, stylesheet or image whose
file the site lacks, on a link that leaves the site, or on an asset loaded from elsewhere.
tests/unit/test_docs.py checks the check on small sites of its own (no MkDocs needed there).

The example notebook is rendered from examples/notebook.ipynb, whose links are the repository's
(`../docs/notebook.md`): `on_page_content` points them at the site's pages.

Code blocks without a language (the pages' indented blocks) are shell, highlighted and wrapped
(docs/assets/extra.css); `on_page_content` shows one that starts with a `$ ` prompt as a terminal
session instead: the prompt's line highlighted as shell, what follows as plain output, and its
lines kept whole (a table such as `dtf status`'s would not survive wrapping).

The API reference (docs/api.md) is read from dtf's source by mkdocstrings (griffe parses it):
building the site imports neither dtf nor TensorFlow, which `on_config` makes an error.
"""

from __future__ import annotations

import importlib.abc
import posixpath
import re
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name

try:
    from mkdocs.plugins import event_priority
except ImportError:  # tests/unit/test_docs.py reads this module where MkDocs is not installed
    event_priority = lambda priority: lambda method: method  # noqa: E731

# (tag, attribute) pairs whose relative URL must be a file of the site; of those, the ones that
# load something into the page (which must not come from another host).
LINKS = {("a", "href"), ("link", "href"), ("script", "src"), ("img", "src"), ("iframe", "src"),
         ("source", "src")}
LOADS = {("link", "href"), ("script", "src"), ("img", "src"), ("iframe", "src"), ("source", "src")}
# <link rel=...> values that only name a URL (the page's canonical address, a feed), loading nothing.
NOT_LOADED_RELS = {"canonical", "alternate", "prev", "next", "search", "author", "license"}
# A code block pymdownx.highlight rendered as shell (mkdocs.yml: default_lang, pygments_lang_class).
_SHELL_BLOCK = re.compile(r'<div class="language-shell highlight"><pre><span></span><code>(.*?)</code></pre></div>', re.S)
# Links from examples/ to the repository's docs/ (`../docs/notebook.md#x`), as the site names them.
_REPO_DOC_LINK = re.compile(r'href="\.\./docs/([\w-]+)\.md(#[^"]*)?"')


class _Refs(HTMLParser):
    """Every (tag, attribute, URL) of LINKS in a page, and whether it sits in the navigation."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str, str, bool]] = []
        self._nav: list[str] = []  # open tags, while inside a <nav>

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v for k, v in attrs if v is not None}
        if tag == "nav" or self._nav:
            self._nav.append(tag)
        if tag == "link" and NOT_LOADED_RELS & set(values.get("rel", "").split()):
            return
        for name, value in values.items():
            if (tag, name) in LINKS:
                self.refs.append((tag, name, value, bool(self._nav)))

    def handle_endtag(self, tag: str) -> None:
        if self._nav and tag in self._nav:
            while self._nav.pop() != tag:
                pass

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if self._nav:
            self._nav.pop()


def page_refs(html: str) -> list[tuple[str, str, str, bool]]:
    """(tag, attribute, URL, in a <nav>) of every link and loaded asset of a page."""
    parser = _Refs()
    parser.feed(html)
    parser.close()
    return parser.refs


def problems(site: Path) -> list[str]:
    """What would not work in the site at `site` opened from disk, one line each (none: it works).
    The home page must have navigation links (a check that found none would pass anything)."""
    if not (site / "index.html").is_file():
        return [f"{site}: no index.html"]
    out: list[str] = []
    if (site / "search" / "search_index.json").is_file() and not (site / "search" / "search_index.js").is_file():
        out.append("search/search_index.js is missing: opened from disk, search reads the index from it "
                   "(the offline plugin writes it)")
    # 404.html is a server's answer for any missing address, so its links are absolute (from the
    # site's root); opened from disk nothing leads to it.
    pages = sorted(p for p in site.rglob("*.html") if p.relative_to(site).as_posix() != "404.html")
    for page in pages:
        name = page.relative_to(site).as_posix()
        refs = page_refs(page.read_text(encoding="utf-8"))
        if name == "index.html" and not any(nav and tag == "a" for tag, _, _, nav in refs):
            out.append("index.html: no navigation link found (is it still a MkDocs page?)")
        for tag, attribute, url, _ in refs:
            parts = urlsplit(url)
            if parts.scheme or parts.netloc:  # another host (or mailto:, data:, javascript:)
                if (tag, attribute) in LOADS and parts.scheme in ("http", "https", "") and parts.netloc:
                    out.append(f"{name}: <{tag} {attribute}={url!r}> loads from outside the site")
                continue
            if not parts.path:  # #anchor or ?query: this page
                continue
            if parts.path.startswith("/"):
                out.append(f"{name}: <{tag} {attribute}={url!r}>: an absolute path (from disk: the file system's root)")
                continue
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), unquote(parts.path)))
            if target == ".." or target.startswith("../"):
                out.append(f"{name}: <{tag} {attribute}={url!r}> leaves the site")
            elif (site / target).is_dir():
                out.append(f"{name}: <{tag} {attribute}={url!r}> is a folder (from disk: a directory listing)")
            elif not (site / target).is_file():
                out.append(f"{name}: <{tag} {attribute}={url!r}>: no {target} in the site")
    return out


# ---- the MkDocs hooks --------------------------------------------------------------------------
class _NotImported(importlib.abc.MetaPathFinder):
    """Refuses the packages the site's build must not import (the docs extra has no TensorFlow)."""

    PACKAGES = ("dtf", "dtf_server", "tensorflow", "tf_keras", "keras")

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in self.PACKAGES:
            raise ImportError(f"building the site imported {name}: the API reference must be read "
                              f"from the source (mkdocstrings' griffe), not imported")


def on_config(config: Any) -> None:
    if not any(isinstance(f, _NotImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _NotImported())


def sessions_as_console(html: str) -> str:
    """Each shell block of a page that starts with a `$ ` prompt, highlighted as a terminal session."""
    def console(m: re.Match[str]) -> str:
        source = unescape(re.sub(r"<[^>]+>", "", m.group(1)))
        if not source.startswith("$ "):
            return m.group(0)
        code = highlight(source, get_lexer_by_name("console"), HtmlFormatter(nowrap=True)).rstrip("\n")
        return f'<div class="language-console highlight"><pre><span></span><code>{code}</code></pre></div>'

    return _SHELL_BLOCK.sub(console, html)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Terminal sessions shown as such; the example notebook's links to the repository's docs/
    pages made links to the site's."""
    if page.file.src_uri.endswith(".ipynb"):
        return _REPO_DOC_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', html)
    return sessions_as_console(html)


@event_priority(-200)  # after the offline plugin's (-100), which writes search/search_index.js
def on_post_build(config: Any) -> None:
    from mkdocs.exceptions import PluginError

    found = problems(Path(config.site_dir))
    if found:
        raise PluginError("the site does not work opened from disk:\n  " + "\n  ".join(found))
