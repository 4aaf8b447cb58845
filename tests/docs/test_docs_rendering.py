"""What a reader sees on the lesson pages: rendered tables, no test plumbing, no stray reprs.

These read the built HTML (the ``site`` fixture of ``test_docs_site`` builds it when stale).
"""

from __future__ import annotations

import html
import itertools
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import pytest
from test_docs_site import site  # noqa: F401  (the fixture that builds the site)

REPO = Path(__file__).resolve().parents[2]
# The docs extensions, importable as Sphinx has them (docs/conf.py puts docs/_ext on the path).
sys.path.insert(0, str(REPO / "docs" / "_ext"))
from fsdp_links import documented_on, lesson_imports  # noqa: E402

LESSONS = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# A line of a Markdown pipe table that was shown as text instead of rendered as a table.
RAW_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$", re.M)
# The value of a plotting call left as a cell's last expression: (0.0, 18.84) or a
# <matplotlib.…> repr, shown between the table and the chart.
PLOT_REPR = re.compile(r"^\s*(\(-?[\d.e+-]+, -?[\d.e+-]+\)|<matplotlib\.[^>]*>)\s*$", re.M)


class _Blocks(HTMLParser):
    """Text of the elements whose class list contains ``wanted`` (nested ones included)."""

    def __init__(self, wanted: str) -> None:
        super().__init__()
        self.wanted = wanted
        self.depth = 0  # >0 while inside a wanted element
        self.blocks: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if self.depth:
            self.depth += 1
            if tag in ("div", "p", "pre", "tr", "li", "br"):
                self.blocks[-1] += "\n"  # a new block starts a new line
        elif self.wanted in classes:
            self.depth = 1
            self.blocks.append("")

    def handle_endtag(self, tag: str) -> None:
        if self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.blocks[-1] += data


def blocks(page: Path, wanted: str) -> list[str]:
    parser = _Blocks(wanted)
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.blocks


def lesson_page(site_dir: Path, name: str) -> Path:
    return site_dir / "notebooks" / f"{name}.html"


@pytest.mark.parametrize("name", LESSONS)
def test_markdown_tables_in_outputs_are_rendered_as_tables(site: Path, name: str) -> None:  # noqa: F811
    raw = [
        m.group(0)
        for b in blocks(lesson_page(site, name), "cell_output")
        for m in RAW_TABLE_ROW.finditer(b)
    ]
    assert not raw, f"{name}: pipe-table text shown raw, e.g. {raw[0]!r}"


@pytest.mark.parametrize("name", LESSONS)
def test_no_nbval_plumbing_in_rendered_code(site: Path, name: str) -> None:  # noqa: F811
    code = "\n".join(blocks(lesson_page(site, name), "cell_input"))
    assert "NBVAL" not in code


@pytest.mark.parametrize("name", LESSONS)
def test_no_bare_repr_of_a_plotting_call(site: Path, name: str) -> None:  # noqa: F811
    stray = [
        m.group(0).strip()
        for b in blocks(lesson_page(site, name), "cell_output")
        for m in PLOT_REPR.finditer(b)
    ]
    assert not stray, f"{name}: {stray}"


def test_the_checks_catch_each_defect(tmp_path: Path) -> None:
    """The same parsing over a deliberately broken page finds all three defects."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<div class="cell_input"><pre># NBVAL_CHECK_OUTPUT\nprint(1)</pre></div>'
        '<div class="cell_output"><div><p>| strategy | ZeRO |\n| --- | --- |</p></div>'
        "<pre>(0.0, 18.84)</pre></div>"
    )
    outputs = blocks(page, "cell_output")
    assert any(RAW_TABLE_ROW.search(b) for b in outputs)
    assert any(PLOT_REPR.search(b) for b in outputs)
    assert "NBVAL" in "\n".join(blocks(page, "cell_input"))


def test_api_index_lists_the_core_modules_first_with_summaries(site: Path) -> None:  # noqa: F811
    text = (site / "api" / "index.html").read_text(encoding="utf-8")
    core = ["launcher", "memory", "wrap", "checkpoint", "strategies"]
    positions = [text.index(f'href="fsdp_guide.{name}.html"') for name in core]
    assert positions == sorted(positions)
    assert positions[-1] < text.index("Supporting modules")
    # autosummary's table: each module with the first line of its docstring.
    rows = re.findall(r'<tr class="row-(?:odd|even)">(.*?)</tr>', text, re.S)
    assert len(rows) >= 17
    for row in rows:
        summary = re.sub(r"<[^>]+>", "", row.split("</td>", 1)[1]).strip()
        assert len(summary) > 10, f"no summary: {row[:200]}"


@pytest.mark.parametrize(
    ("page", "first"),
    [
        ("fsdp_guide.launcher", "launch"),
        ("fsdp_guide.memory", "measure_model_state"),
        ("fsdp_guide.checkpoint", "save"),
        ("fsdp_guide.wrap", "SizePolicy"),
    ],
)
def test_each_core_page_documents_its_main_name_first(site: Path, page: str, first: str) -> None:  # noqa: F811
    html_text = (site / "api" / f"{page}.html").read_text(encoding="utf-8")
    ids = re.findall(rf'<dt class="sig sig-object py" id="{re.escape(page)}\.(\w+)"', html_text)
    assert ids and ids[0] == first, ids[:4]


CORE = ["launcher", "memory", "wrap", "checkpoint", "strategies"]


def _links(page: Path) -> set[str]:
    return set(re.findall(r'href="([^"#]+)', page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("name", LESSONS)
def test_each_lesson_links_to_the_api_of_what_it_imports(site: Path, name: str) -> None:  # noqa: F811
    notebook = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())
    links = _links(lesson_page(site, name))
    for module, imported in lesson_imports(notebook):
        page = documented_on(module, imported)
        assert f"../api/{page}.html" in links, f"{name} imports {module}.{imported}, no link"


def _pages_used_by(name: str) -> set[str]:
    notebook = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())
    return {documented_on(module, imported) for module, imported in lesson_imports(notebook)}


@pytest.mark.parametrize("page", [f"fsdp_guide.{n}" for n in CORE])
def test_each_core_api_page_links_back_to_the_lessons_using_it(site: Path, page: str) -> None:  # noqa: F811
    links = _links(site / "api" / f"{page}.html")
    users = [name for name in LESSONS if page in _pages_used_by(name)]
    # A page no lesson uses (checkpoint, for now) has no lessons to link back to.
    assert ("Used in the lessons" in (site / "api" / f"{page}.html").read_text()) == bool(users)
    for name in users:
        assert f"../notebooks/{name}.html" in links, f"{page} does not link to {name}"


class _Outline(HTMLParser):
    """Headings of the article in order, each with whether text followed it before the next."""

    CONTENT: ClassVar[set[str]] = {"p", "table", "pre", "ul", "ol", "img", "dl", "figure"}

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[list[str | bool]] = []  # [text, followed_by_content]
        self.in_heading = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if re.fullmatch(r"h[1-6]", tag):
            self.headings.append(["", False])
            self.in_heading = True
        elif tag in self.CONTENT and self.headings:
            self.headings[-1][1] = True

    def handle_endtag(self, tag: str) -> None:
        if re.fullmatch(r"h[1-6]", tag):
            self.in_heading = False

    def handle_data(self, data: str) -> None:
        if self.in_heading:
            self.headings[-1][0] = str(self.headings[-1][0]) + data


def stacked_headings(page: Path) -> list[tuple[str, str]]:
    """Pairs of headings with nothing between them: a section that repeats its own title."""
    outline = _Outline()
    text = page.read_text(encoding="utf-8")
    start = text.find("<article")  # the page's own content, not the sidebars
    outline.feed(text[start : text.find("</article>", start)] if start >= 0 else text)
    heads = outline.headings
    return [
        (str(a[0]).strip(" #¶"), str(b[0]).strip(" #¶"))
        for a, b in itertools.pairwise(heads)
        if not a[1]
    ]


@pytest.mark.parametrize("page", ["guide/choosing.html", "benchmarks.html"])
def test_measured_sections_do_not_repeat_their_title(site: Path, page: str) -> None:  # noqa: F811
    assert stacked_headings(site / page) == []


def test_stacked_headings_are_found(tmp_path: Path) -> None:
    page = tmp_path / "p.html"
    page.write_text("<h2>Measured: memory</h2><h3>Model state per rank</h3><p>table</p>")
    assert stacked_headings(page) == [("Measured: memory", "Model state per rank")]


def test_cli_page_shows_real_output_of_estimate(site: Path) -> None:  # noqa: F811
    from fsdp_guide.cli._estimate_table import estimate_table

    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "cli.html").read_text(encoding="utf-8")))
    assert "$ python -m fsdp_guide estimate --params 7e9 --world-size 8 --gpu-memory 80GB" in text
    assert estimate_table(7e9, 8, gpu_memory=80 * 10**9).splitlines()[0] in text


FIELDS = ("Parameters", "Returns", "Return type", "Raises")


def repeated_fields(page: Path) -> list[str]:
    """Objects of an API page whose description lists a field (Parameters, ...) twice."""
    text = page.read_text(encoding="utf-8")
    found = []
    for chunk in text.split('<dt class="sig sig-object py"')[1:]:
        name = re.search(r'id="([^"]+)"', chunk)
        for field in FIELDS:
            if len(re.findall(rf'<dt class="field-(?:odd|even)">{field}<', chunk)) > 1:
                found.append(f"{name.group(1) if name else '?'}: {field}")
    return found


def test_no_api_page_lists_a_field_twice(site: Path) -> None:  # noqa: F811
    pages = sorted((site / "api").glob("*.html"))
    assert pages
    assert [f"{p.name} {r}" for p in pages for r in repeated_fields(p)] == []


def test_repeated_fields_are_found(tmp_path: Path) -> None:
    page = tmp_path / "api.html"
    one = '<dt class="field-odd">Parameters<span>:</span></dt>'
    page.write_text(f'<dt class="sig sig-object py" id="m.launch">{one}<p>prose</p>{one}')
    assert repeated_fields(page) == ["m.launch: Parameters"]
