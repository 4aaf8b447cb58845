"""Checks over the built documentation site (docs/_build/html).

CI builds the site with ``python -m sphinx -nW --keep-going`` before running pytest and names
it in ``FSDP_GUIDE_SITE``: the tests read that build. Without the variable, the fixture below
builds the site the same way when the HTML is missing or older than its sources.
The checks: every notebook has a page showing its stored outputs, every public name of
``fsdp_guide`` is in the API reference, every internal link and anchor resolves, and the
pages generated from the repository (CLI help, benchmark tables) follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import html
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote, urlsplit

import pytest

import fsdp_guide
from fsdp_guide.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SITE = DOCS / "_build" / "html"
NOTEBOOKS = REPO / "notebooks"
RESULTS = REPO / "benchmarks" / "results"
# Mime types in the order myst-nb picks one to render for HTML.
MIME_PRIORITY = (
    "text/html",
    "image/svg+xml",
    "image/png",
    "image/jpeg",
    "text/markdown",
    "text/latex",
    "text/plain",
)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Sphinx's smartquotes turn ' and " in prose into typographic quotes.
SMART_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
# Cell tags with which myst-nb shows no output (the text says why, or the cell is hidden).
TAGS_WITHOUT_OUTPUT = {"remove-output", "remove-cell"}


# -- building and parsing ----------------------------------------------------------------


def _sources() -> Iterator[Path]:
    generated = {"_build", "_generated", "notebooks"}
    for path in DOCS.rglob("*"):
        parts = path.relative_to(DOCS).parts
        if parts[0] == "api" and path.name.startswith("fsdp_guide"):
            continue  # written by autosummary
        if path.is_file() and not (parts[0] in generated or "__pycache__" in parts):
            yield path
    yield from NOTEBOOKS.glob("*.ipynb")
    yield from (REPO / "fsdp_guide").rglob("*.py")
    yield from RESULTS.glob("*.md")


def _site_is_stale() -> bool:
    # docs/_ext/fsdp_docs.py writes this marker only after a build without any warning.
    marker = SITE / ".fsdp-docs-clean-build"
    if not marker.exists():
        return True
    built = marker.stat().st_mtime
    return any(path.stat().st_mtime > built for path in _sources())


@pytest.fixture(scope="module")
def site() -> Path:
    """The built HTML site; built here (as CI builds it) when missing, stale or not clean.

    The build starts from a fresh environment (-E): an incremental build does not repeat
    the warnings of pages it does not read again. ``FSDP_GUIDE_SITE`` names a site already
    built from this checkout (CI's, built with the same command just before the tests).
    """
    if built := os.environ.get("FSDP_GUIDE_SITE"):
        path = Path(built)
        assert (path / ".fsdp-docs-clean-build").exists(), (
            f"FSDP_GUIDE_SITE={built} holds no clean build (no warning-free sphinx run wrote "
            "it): build the docs there, or unset the variable to build them here"
        )
        return path
    with _one_builder():
        if _site_is_stale():
            _build_site()
    return SITE


@contextlib.contextmanager
def _one_builder() -> Iterator[None]:
    """Hold the build's lock: with ``pytest -n 2`` another worker may need the site too; it
    waits here, then finds the site fresh."""
    lock = DOCS / "_build" / ".site-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _build_site() -> None:
    command = [sys.executable, "-m", "sphinx", "-nW", "--keep-going", "-E", "-q", "-b", "html"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    started = time.monotonic()
    done = subprocess.run(
        [*command, str(DOCS), str(SITE)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"docs build failed:\n{done.stdout}\n{done.stderr}"
    # -q leaves only warnings on stderr; a Python warning printed there is one too.
    assert done.stderr.strip() == "", f"the docs build printed:\n{done.stderr}"
    assert not _site_is_stale(), "the build passed but left no clean-build marker"
    print(f"built the docs in {time.monotonic() - started:.1f} s")


@dataclass
class OutputBlock:
    """One rendered ``div.cell_output``: its text, tables and images."""

    text: list[str] = field(default_factory=list)
    tables: int = 0
    images: list[str] = field(default_factory=list)


class Page(HTMLParser):
    """What the checks need from one HTML file."""

    def __init__(self, path: Path) -> None:
        super().__init__(convert_charrefs=True)
        self.path = path
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (attribute, url) of href/src
        self.anchors: list[tuple[str, str]] = []  # (href, link text)
        self.text: list[str] = []
        self.h1: list[str] = []
        self.outputs: list[OutputBlock] = []
        self._stack: list[str] = []
        self._output_depth: int | None = None
        self._in_h1 = False
        self._anchor: list[str] | None = None
        self._anchor_href = ""
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        for name in ("id", "name"):
            if values.get(name) and (name == "id" or tag == "a"):
                self.ids.add(values[name])
        for name in ("href", "src"):
            if name in values:
                self.links.append((name, values[name]))
        if tag in {"img", "br", "hr", "meta", "link", "input", "source"}:
            if tag == "img" and self._output_depth is not None:
                self.outputs[-1].images.append(values.get("src", ""))
            return  # void elements never close
        self._stack.append(tag)
        classes = values.get("class", "").split()
        if tag == "div" and "cell_output" in classes and self._output_depth is None:
            self._output_depth = len(self._stack)
            self.outputs.append(OutputBlock())
        if self._output_depth is not None and tag in {"table", "svg"}:
            if tag == "table":
                self.outputs[-1].tables += 1
            else:
                self.outputs[-1].images.append("inline-svg")
        if tag == "h1":
            self._in_h1 = True
        if tag == "a":
            self._anchor, self._anchor_href = [], values.get("href", "")

    def handle_endtag(self, tag: str) -> None:
        if tag in {"img", "br", "hr", "meta", "link", "input", "source"}:
            return
        if self._output_depth is not None and len(self._stack) == self._output_depth:
            self._output_depth = None
        if self._stack:
            self._stack.pop()
        if tag == "h1":
            self._in_h1 = False
        if tag == "a" and self._anchor is not None:
            self.anchors.append((self._anchor_href, "".join(self._anchor)))
            self._anchor = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._output_depth is not None:
            self.outputs[-1].text.append(data)
        if self._in_h1:
            self.h1.append(data)
        if self._anchor is not None:
            self._anchor.append(data)

    @property
    def plain(self) -> str:
        return squash("".join(self.text))


def squash(text: str) -> str:
    """Text with ANSI colours removed, smart quotes made plain, whitespace runs one space."""
    text = ANSI_ESCAPE.sub("", text).translate(SMART_QUOTES)
    return " ".join(text.split())


_pages: dict[Path, Page] = {}


def page(path: Path) -> Page:
    """Parse ``path`` once per test session."""
    if path not in _pages:
        _pages[path] = Page(path)
    return _pages[path]


# -- notebooks ---------------------------------------------------------------------------


def _joined(value: str | list[str]) -> str:
    return "".join(value) if isinstance(value, list) else value


def _rendered_code_cells(notebook: dict) -> list[dict]:
    """Code cells whose outputs the page must show, in order."""
    cells = []
    for cell in notebook["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "code" and cell.get("outputs") and not tags & TAGS_WITHOUT_OUTPUT:
            cells.append(cell)
    return cells


def _check_output(output: dict, block: OutputBlock, where: str) -> list[str]:
    """Problems with how one stored output is rendered in ``block``."""
    shown = squash("".join(block.text))
    kind = output["output_type"]
    if kind == "stream":
        lines = [squash(line) for line in _joined(output["text"]).splitlines()]
        return [f"{where}: stream line {line!r} missing" for line in lines if line not in shown]
    if kind == "error":
        ok = output["ename"] in shown
        return [] if ok else [f"{where}: error {output['ename']} missing"]
    data = output.get("data", {})
    mime = next((m for m in MIME_PRIORITY if m in data), None)
    if mime == "text/html":
        stored = _joined(data[mime])
        tables = stored.lower().count("<table")
        if tables and block.tables < tables:
            return [f"{where}: {tables} table(s) stored, {block.tables} rendered"]
        words = squash(re.sub(r"<[^>]+>", " ", html.unescape(stored))).split()
        missing = [word for word in words[:50] if word not in shown]
        return [f"{where}: html words {missing[:5]} missing"] if missing else []
    if mime in {"image/svg+xml", "image/png", "image/jpeg"}:
        return [] if block.images else [f"{where}: {mime} image not rendered"]
    if mime == "text/plain":
        lines = [squash(line) for line in _joined(data[mime]).splitlines()]
        return [f"{where}: text line {line!r} missing" for line in lines if line not in shown]
    return []


def _notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def test_every_notebook_has_a_page_with_its_stored_outputs(site: Path) -> None:
    problems: list[str] = []
    for path in _notebook_paths():
        html_path = site / "notebooks" / f"{path.stem}.html"
        if not html_path.exists():
            problems.append(f"{path.name}: no page {html_path.relative_to(site)}")
            continue
        notebook = json.loads(path.read_text(encoding="utf-8"))
        rendered = page(html_path)
        cells = _rendered_code_cells(notebook)
        if len(rendered.outputs) != len(cells):
            problems.append(
                f"{path.name}: {len(cells)} cells with stored outputs, "
                f"{len(rendered.outputs)} output blocks rendered"
            )
            continue
        for number, (cell, block) in enumerate(zip(cells, rendered.outputs, strict=True)):
            for output in cell["outputs"]:
                problems += _check_output(output, block, f"{path.name} output cell {number}")
        download = f"_sources/notebooks/{path.name}"
        if not any(url.endswith(download) for _, url in rendered.links):
            problems.append(f"{path.name}: no download link to the .ipynb")
        if not (site / download).exists():
            problems.append(f"{path.name}: {download} missing from the site")
    assert not problems, "\n".join(problems)


def test_lessons_page_lists_every_notebook_in_lesson_order(site: Path) -> None:
    lessons = page(site / "notebooks" / "index.html")
    names = [p.stem for p in _notebook_paths()]
    if not names:
        assert "No lesson has been written yet" in lessons.plain
        return
    hrefs = [href for href, _ in lessons.anchors]
    positions = [hrefs.index(f"{name}.html") for name in names if f"{name}.html" in hrefs]
    assert len(positions) == len(names), f"lessons missing from the index: {names} vs {hrefs}"
    assert positions == sorted(positions), "lessons are not in lesson order"


# -- API reference -----------------------------------------------------------------------


def _public_modules() -> list[str]:
    names = ["fsdp_guide"]

    def fail(name: str) -> None:
        raise ImportError(name)

    for info in pkgutil.walk_packages(fsdp_guide.__path__, prefix="fsdp_guide.", onerror=fail):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


def _public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name
    ]


def _documented_at(site: Path, module_name: str, name: str) -> str | None:
    """Where the API page of ``module_name`` documents ``name``; None when it does not."""
    html_path = site / "api" / f"{module_name}.html"
    api = page(html_path)
    if f"{module_name}.{name}" in api.ids:
        return f"{html_path.name}#{module_name}.{name}"
    # A re-exported name: a row linking to its entry in the defining module.
    for href, text in api.anchors:
        target, _, anchor = href.partition("#")
        if anchor.endswith(f".{name}") and name in text and target:
            target_page = page((html_path.parent / target).resolve())
            if anchor in target_page.ids:
                return href
    return None


def test_every_public_name_is_in_the_api_reference(site: Path) -> None:
    missing = []
    modules = _public_modules()
    assert {"fsdp_guide", "fsdp_guide.launcher", "fsdp_guide.models"} <= set(modules)
    for module_name in modules:
        if not (site / "api" / f"{module_name}.html").exists():
            missing.append(f"{module_name}: no API page")
            continue
        for name in _public_names(module_name):
            if _documented_at(site, module_name, name) is None:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"not in the API reference: {missing}"


def test_api_reference_renders_docstrings(site: Path) -> None:
    """The summary line of every public function and class defined in a module is shown."""
    missing = []
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        text = page(site / "api" / f"{module_name}.html").plain
        for name in _public_names(module_name):
            value = getattr(module, name)
            if getattr(value, "__module__", None) != module_name or not value.__doc__:
                continue
            summary = squash(value.__doc__.strip().splitlines()[0])
            # A role's target renders as written, or as its last part after "~".
            plain = re.sub(r":\w+:`~[^`]*?([^.`]+)`", r"\1", summary)
            plain = re.sub(r":\w+:`([^`]+)`|``([^`]+)``", r"\1\2", plain)
            # Sphinx renders :func: targets with "()" appended.
            if plain.rstrip(".").replace("()", "") not in text.replace("()", ""):
                missing.append(f"{module_name}.{name}: {plain!r}")
    assert not missing, "\n".join(missing)


# -- links -------------------------------------------------------------------------------


def test_internal_links_and_anchors_resolve(site: Path) -> None:
    broken = []
    # _static holds theme templates (Jinja macros), not pages.
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.relative_to(site).parts)
    assert len(pages) > 5
    for html_path in pages:
        for attribute, url in page(html_path).links:
            parts = urlsplit(url)
            if parts.scheme or url.startswith("//") or not (parts.path or parts.fragment):
                continue
            target = (html_path.parent / unquote(parts.path)).resolve() if parts.path else html_path
            if target.is_dir():
                target = target / "index.html"
            where = f"{html_path.relative_to(site)}: {attribute}={url}"
            if not target.exists():
                broken.append(f"{where} (no file)")
            elif (
                parts.fragment
                and target.suffix == ".html"
                and unquote(parts.fragment) not in page(target).ids
            ):
                broken.append(f"{where} (no anchor)")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken[:40])


# -- pages generated from the repository -------------------------------------------------


def test_cli_page_shows_every_command(site: Path) -> None:
    """sphinx-argparse renders every command and option from the parser itself."""
    text = page(site / "cli.html").plain
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "demo" in sub.choices
    for name, command in sub.choices.items():
        assert f"python -m fsdp_guide {name}" in text, f"command {name} missing from cli.html"
        for action in command._actions:
            if action.help == argparse.SUPPRESS or "--help" in action.option_strings:
                continue  # sphinx-argparse leaves -h out: every command has it
            for option in action.option_strings:
                assert option in text, f"{name} {option} missing from cli.html"


def _table_cells(markdown: str) -> list[str]:
    cells = []
    for line in markdown.splitlines():
        if line.strip().startswith("|") and not re.fullmatch(r"[\s|:-]+", line):
            cells += [squash(c.replace("`", "").replace("*", "")) for c in line.split("|")]
    return [c for c in cells if c]


def test_benchmarks_page_shows_every_committed_result(site: Path) -> None:
    text = page(site / "benchmarks.html").plain
    results = sorted(RESULTS.glob("*.md"))
    if not results:
        assert "No benchmark result has been committed yet" in text
    for path in results:
        assert f"benchmarks/results/{path.name}" in text
        cells = _table_cells(path.read_text(encoding="utf-8"))
        missing = [cell for cell in cells if cell not in text]
        assert not missing, f"{path.name}: cells {missing[:5]} missing from benchmarks.html"


@pytest.mark.parametrize("name", ["memory_vs_zero", "strategy_overhead", "launch_overhead"])
def test_choosing_page_shows_measured_table_or_says_it_is_pending(site: Path, name: str) -> None:
    text = page(site / "guide" / "choosing.html").plain
    result = RESULTS / f"{name}.md"
    if result.exists():
        cells = _table_cells(result.read_text(encoding="utf-8"))
        assert cells and all(cell in text for cell in cells)
        assert f"benchmarks/results/{name}.md" not in text  # no stale placeholder
    else:
        assert f"Measured table pending: it appears here once benchmarks/{name}.py" in text


def test_landing_page_has_zero_table_and_figure(site: Path) -> None:
    landing = page(site / "index.html")
    for word in ("FairScale", "PyTorch", "DeepSpeed", "Lightning", "ZeRO-3", "OSS"):
        assert word in landing.plain
    assert any(url.endswith("zero_stages.svg") for _, url in landing.links)


@pytest.mark.parametrize(
    "old_name",
    [
        "cpu_offload",
        "flatten_parameters",
        "reshard_after_forward",
        "move_grads_to_cpu",
        "fp32_reduce_scatter",
        "compute_dtype",
        "bucket_cap_mb",
        "min_num_params",
        "state_dict_to_cpu",
        "configure_sharded_model",
        "from pytorch_lightning.strategies import DDPShardedStrategy",
        "ddp_sharded",
        "ddp_fully_sharded",
    ],
)
def test_migration_page_maps_old_names(site: Path, old_name: str) -> None:
    assert old_name in page(site / "guide" / "migration.html").plain


# -- the generator (docs/_ext/fsdp_docs.py), without a full build ------------------------


def _extension(name: str) -> ModuleType:
    """docs/_ext/<name>.py, loaded from its file (with docs/_ext importable, as Sphinx has it)."""
    if str(DOCS / "_ext") not in sys.path:
        sys.path.insert(0, str(DOCS / "_ext"))
    spec = importlib.util.spec_from_file_location(name, DOCS / "_ext" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generator() -> ModuleType:
    return _extension("fsdp_docs")


def _write_notebook(path: Path, title: str) -> None:
    cell = {"cell_type": "markdown", "metadata": {}, "source": [f"# {title}\n", "text"]}
    path.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4}))


def test_no_notebooks_gives_a_lessons_page_without_lessons(tmp_path: Path) -> None:
    names = _generator().sync_notebooks(tmp_path / "missing", tmp_path / "out")
    assert names == []
    index = (tmp_path / "out" / "index.md").read_text()
    assert "No lesson has been written yet" in index and "toctree" not in index


def test_notebooks_are_copied_in_lesson_order_and_stale_copies_removed(tmp_path: Path) -> None:
    source, target = tmp_path / "notebooks", tmp_path / "docs_notebooks"
    source.mkdir()
    target.mkdir()
    for name, title in [("10_later", "Later"), ("02_second", "Second"), ("01_first", "First")]:
        _write_notebook(source / f"{name}.ipynb", title)
    _write_notebook(target / "03_deleted.ipynb", "Deleted")
    names = _generator().sync_notebooks(source, target)
    assert names == ["01_first.ipynb", "02_second.ipynb", "10_later.ipynb"]
    assert sorted(p.name for p in target.glob("*.ipynb")) == names
    index = (target / "index.md").read_text()
    assert index.index("[First]") < index.index("[Second]") < index.index("[Later]")
    assert "01_first\n02_second\n10_later" in index


@pytest.mark.parametrize("bad_name", ["lesson.ipynb", "1-intro.ipynb", "intro_01.ipynb"])
def test_a_misnamed_notebook_fails_the_build_naming_the_fix(tmp_path: Path, bad_name: str) -> None:
    (tmp_path / "notebooks").mkdir()
    _write_notebook(tmp_path / "notebooks" / bad_name, "Bad")
    with pytest.raises(ValueError, match=r"rename them .*NN_topic|NN_topic\.ipynb; rename"):
        _generator().sync_notebooks(tmp_path / "notebooks", tmp_path / "out")


def test_results_are_mirrored_and_missing_ones_get_a_placeholder(tmp_path: Path) -> None:
    docs, results, generated = tmp_path / "docs", tmp_path / "results", tmp_path / "generated"
    docs.mkdir()
    results.mkdir()
    (docs / "page.md").write_text("```{include} /_generated/results/pending_one.md\n```\n")
    (results / "measured.md").write_text("# Measured\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    committed = _generator().generate_result_pages(results, generated, docs)
    assert committed == ["measured"]
    assert "| 1 | 2 |" in (generated / "results" / "measured.md").read_text()
    placeholder = (generated / "results" / "pending_one.md").read_text()
    assert "benchmarks/pending_one.py" in placeholder
    gathered = (generated / "benchmarks.md").read_text()
    assert "/_generated/results/measured.md" in gathered and "pending_one" not in gathered


def test_a_results_figure_travels_with_its_table(tmp_path: Path) -> None:
    # A figure beside a table, linked as the repository shows it, is found on the site too.
    docs, results, generated = tmp_path / "docs", tmp_path / "results", tmp_path / "generated"
    docs.mkdir()
    results.mkdir()
    (results / "timed.md").write_text("# Timed\n\n| a |\n| --- |\n\n![two ranks](timed.svg)\n")
    (results / "timed.svg").write_text("<svg/>")
    _generator().generate_result_pages(results, generated, docs)
    assert (generated / "results" / "timed.svg").read_text() == "<svg/>"
    assert (
        "![two ranks](/_generated/results/timed.svg)"
        in (generated / "results" / "timed.md").read_text()
    )


def test_api_pages_follow_each_facades_all_without_docs_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a page documents comes from ``__all__``: a name moved between façades moves."""
    package = tmp_path / "docs_probe_pkg"
    (package / "alpha").mkdir(parents=True)
    (package / "__init__.py").write_text(
        'from docs_probe_pkg.alpha import helper\n__all__ = ["helper", "VERSION"]\nVERSION = "1"\n'
    )
    (package / "alpha" / "__init__.py").write_text(
        'from docs_probe_pkg.alpha._impl import helper\n__all__ = ["helper"]\n'
    )
    (package / "alpha" / "_impl.py").write_text(
        'def helper() -> int:\n    """Help."""\n    return 1\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    links = _extension("fsdp_links")
    modules = links.public_modules("docs_probe_pkg")
    assert modules == ["docs_probe_pkg", "docs_probe_pkg.alpha"]  # _impl stays private
    top = links.api_page("docs_probe_pkg", modules)
    alpha = links.api_page("docs_probe_pkg.alpha", modules)
    assert alpha["short"] == ["helper"]
    assert ".. autofunction:: docs_probe_pkg.alpha.helper\n" in alpha["entries"]
    assert top["elsewhere"] == [("helper", "docs_probe_pkg.alpha")]  # documented once
    assert any("py:data:: VERSION" in entry for entry in top["entries"])
    for name in list(sys.modules):
        if name.startswith("docs_probe_pkg"):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize(
    ("target", "module", "cls", "external"),
    [
        ("linecache", None, None, True),  # a standard-library module
        ("Ellipsis", None, None, True),  # a builtin
        ("Tensor", "fsdp_guide.models", None, True),  # imported there from torch
        ("RankError", "fsdp_guide.models", None, False),  # ours, but not reachable from there
        ("RankErorr", "fsdp_guide.launcher", None, False),  # a typo stays a broken reference
        ("fsdp_guide.nothing", None, None, False),
        # A class documented on its façade: its signature's names, where it is defined.
        ("Precision", "fsdp_guide.strategies", "DDPShardedStrategy", True),  # Lightning's
        ("StartMethod", "fsdp_guide.strategies", "DDPShardedStrategy", True),  # private
        ("StartMethdo", "fsdp_guide.strategies", "DDPShardedStrategy", False),  # a typo
        ("RankPlan", "fsdp_guide.launcher", None, False),  # private, named from a façade
    ],
)
def test_only_third_party_and_private_names_are_kept_quiet(
    target: str, module: str | None, cls: str | None, external: bool
) -> None:
    assert _extension("fsdp_refs").is_external_name(target, module, cls) is external


# -- lessons' links into docs/ and their "API used" section, on the site's copy -------------


GLOSSARY_LINK = re.compile(r"\]\(\.\./docs/guide/glossary\.md#(term-[^)\s]+)\)")


def test_every_term_a_lesson_may_link_has_an_entry_the_copy_can_reach() -> None:
    sys.path.insert(0, str(REPO / "tests" / "lessons"))
    from test_lesson_shape import TERMS

    terms = _generator().glossary_terms((DOCS / "guide" / "glossary.md").read_text())
    slugs = {re.sub(r"[^A-Za-z0-9._]+", "-", t).lower(): t for t in TERMS}
    assert {f"term-{s}": t for s, t in slugs.items()}.items() <= terms.items()


@pytest.mark.parametrize(
    ("lesson", "copy"),
    [
        (
            "Each rank [reduce-scatters](../docs/guide/glossary.md#term-reduce-scatter) its part.",
            "Each rank {term}`reduce-scatters <reduce-scatter>` its part.",
        ),
        (
            "a [DTensor](../docs/guide/glossary.md#term-DTensor) shard",
            "a {term}`DTensor <DTensor>` shard",
        ),
        ("see [the CLI](../docs/cli.md#compare)", "see [the CLI](../cli.md#compare)"),
        (
            "[elsewhere](https://example.org/docs/x.md)",
            "[elsewhere](https://example.org/docs/x.md)",
        ),
    ],
)
def test_lesson_links_into_docs_are_rewritten_for_the_sites_copy(lesson: str, copy: str) -> None:
    generator = _generator()
    terms = generator.glossary_terms((DOCS / "guide" / "glossary.md").read_text())
    assert generator.site_links(lesson, terms) == copy


def test_a_link_to_a_term_the_glossary_lacks_fails_the_build_naming_it(tmp_path: Path) -> None:
    (tmp_path / "notebooks").mkdir()
    glossary = tmp_path / "docs" / "guide" / "glossary.md"
    glossary.parent.mkdir(parents=True)
    glossary.write_text("```{glossary}\nrank\n  A process.\n```\n")
    text = "# T\n[x](../docs/guide/glossary.md#term-shard)"
    cell = {"cell_type": "markdown", "metadata": {}, "source": text}
    notebook = json.dumps({"cells": [cell], "metadata": {}})
    (tmp_path / "notebooks" / "01_t.ipynb").write_text(notebook)
    with pytest.raises(ValueError, match=r"01_t\.ipynb: .*term-shard.*names no term"):
        _generator().sync_notebooks(tmp_path / "notebooks", tmp_path / "docs" / "notebooks")


def _api_cells(notebook: dict) -> list[str]:
    texts = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
             for c in notebook["cells"] if c["cell_type"] == "markdown"]  # fmt: skip
    return [t for t in texts if re.search(r"^## API used", t, re.M)]


def test_a_lessons_own_api_section_is_linked_not_doubled() -> None:
    code = "from fsdp_guide import launch\nfrom fsdp_guide.memory import plan, format_bytes"
    own = (
        "## API used\n\n- `fsdp_guide.launch`: ran the function on two ranks.\n"
        "- `fsdp_guide.memory.plan`, `fsdp_guide.memory.Plan`: planned each rank's bytes.\n"
    )
    notebook = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": code, "outputs": []},
            {"cell_type": "markdown", "metadata": {}, "source": own},
        ]
    }
    (section,) = _api_cells(_extension("fsdp_links").with_api_section(notebook))
    assert "{py:obj}`fsdp_guide.launch <fsdp_guide.launcher.launch>`: ran the function" in section
    assert (
        "{py:obj}`fsdp_guide.memory.plan`, {py:obj}`fsdp_guide.memory.Plan`: planned each rank's"
        in section
    )
    # Imported but not listed: still linked, in the same section.
    assert "{py:obj}`fsdp_guide.memory.format_bytes`" in section


def test_an_api_bullet_naming_a_name_where_it_does_not_live_fails() -> None:
    own = "## API used\n\n- `fsdp_guide.memory.count_collectives`: counted the collectives.\n"
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": own}]}
    with pytest.raises(ValueError, match="count_collectives is not a public name"):
        _extension("fsdp_links").with_api_section(notebook)


def test_a_lesson_without_its_own_api_section_gets_the_generated_one() -> None:
    code = "from fsdp_guide.wrap import shard"
    notebook = {"cells": [{"cell_type": "code", "metadata": {}, "source": code, "outputs": []}]}
    (section,) = _api_cells(_extension("fsdp_links").with_api_section(notebook))
    assert section.startswith("## API used in this lesson") and "fsdp_guide.wrap.shard" in section


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_each_lesson_page_has_one_api_section(site: Path, name: str) -> None:
    text = (site / "notebooks" / f"{name}.html").read_text(encoding="utf-8")
    headings = re.findall(r"<h2>API used[^<]*<", text)
    assert len(headings) == 1, headings


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_glossary_links_of_a_lesson_land_on_the_entry(site: Path, name: str) -> None:
    notebook = (NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")
    linked = {a.lower() for a in GLOSSARY_LINK.findall(notebook)}
    lesson = (site / "notebooks" / f"{name}.html").read_text(encoding="utf-8")
    hrefs = set(re.findall(r'href="\.\./guide/glossary\.html#(term-[^"]+)"', lesson))
    ids = set(re.findall(r'id="(term-[^"]+)"', (site / "guide" / "glossary.html").read_text()))
    assert hrefs <= ids
    assert linked <= {h.lower() for h in hrefs}
