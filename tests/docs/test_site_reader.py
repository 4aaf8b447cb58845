"""What a newcomer reads on the built site: how to install, public names only, sources linked.

These read the built HTML (the ``site`` fixture of ``test_docs_site`` builds it when stale).
Lesson pages are left out where their text is the lessons' own (their checks live with them).
"""

from __future__ import annotations

import html
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest
from test_docs_site import page, site  # noqa: F401  (the fixture that builds the site)

import fsdp_guide

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
URLS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]
# A private module path, dotted or as a file: fsdp_guide.wrap._policy, fsdp_guide/wrap/_x.py.
PRIVATE_PATH = re.compile(r"fsdp_guide(?:\.\w+)*\._\w|fsdp_guide/(?:\w+/)*_\w+\.py")
# Words for maintainers, not readers (figure captions, API prose).
MAINTAINER_WORDS = (
    "Redraw it with",
    "Drawn by `docs/_scripts",
    "docs/_scripts/",
    "refreshes it",
    "nbval-skip",
    "skip-execution",
    "in our trials",
    "Seed 003",
)


def article_text(path: Path) -> str:
    """The visible text of a page's article (not the navigation), tags removed."""
    text = path.read_text(encoding="utf-8")
    start = text.find("<article")
    body = text[start : text.find("</article>", start)] if start >= 0 else text
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", body, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def reader_pages(site_dir: Path) -> list[Path]:
    """Every page of the site but the lessons, the highlighted sources and the templates."""
    skip = {"_static", "_modules", "_sources", "notebooks"}
    pages = [p for p in site_dir.rglob("*.html") if not skip & set(p.relative_to(site_dir).parts)]
    return sorted(p for p in pages if p.name not in {"genindex.html", "search.html"})


# -- item 1: how to install ----------------------------------------------------------------


def test_install_page_says_how_to_install_what_exists(site: Path) -> None:  # noqa: F811
    text = article_text(site / "install.html")
    for command in (
        'pip install -c requirements/constraints.txt -e ".[notebooks]"',
        "python -m build",
        "pip install dist/fsdp_guide-*.whl",
        "python -m fsdp_guide compare",
    ):
        assert command in text.replace("\u201c", '"').replace("\u201d", '"'), command
    assert re.search(r"not on the Python package index yet", text)


@pytest.mark.parametrize("source", ["index.html", "notebooks/index.html", "cli.html"])
def test_install_page_is_linked(site: Path, source: str) -> None:  # noqa: F811
    """From the page's own text, not only from the side navigation that every page has."""
    text = (site / source).read_text(encoding="utf-8")
    article = text[text.find("<article") : text.find("</article>")]
    assert re.search(r'href="[^"#]*install\.html[#"]', article)


def _index_commands(text: str) -> list[str]:
    """Each ``pip install fsdp-guide`` (from the index) with the sentence or two around it."""
    return [
        text[max(0, m.start() - 200) : m.end() + 120]
        for m in re.finditer(r"pip install [\"']?fsdp-guide\b", text)
    ]


def test_the_index_command_is_only_offered_as_once_published(site: Path) -> None:  # noqa: F811
    found = [(p.name, c) for p in reader_pages(site) for c in _index_commands(article_text(p))]
    found += [("README.md", c) for c in _index_commands((REPO / "README.md").read_text())]
    # Said only as what will work once published, or next to "not on the index yet".
    unmarked = [(where, c) for where, c in found if not re.search(r"published|index yet", c)]
    assert not unmarked, unmarked


def test_every_page_that_offers_a_download_links_the_repository(site: Path) -> None:  # noqa: F811
    assert "Repository" in URLS and URLS["Repository"].startswith("https://")
    offering = [
        p for p in site.rglob("*.html") if "dropdown-download-buttons" in p.read_text("utf-8")
    ]
    assert len(offering) > 10
    missing = [
        str(p.relative_to(site))
        for p in offering
        if not any(href.startswith(URLS["Repository"]) for _, href in page(p).links)
    ]
    assert not missing, missing[:10]
    lessons = [href for href, _ in page(site / "notebooks" / "index.html").anchors]
    assert f"{URLS['Repository']}/tree/main/notebooks" in lessons


# -- item 3: public names and prose only ---------------------------------------------------


def test_no_private_module_path_on_a_reader_page(site: Path) -> None:  # noqa: F811
    found = {
        str(p.relative_to(site)): sorted(set(PRIVATE_PATH.findall(article_text(p))))
        for p in reader_pages(site)
    }
    assert {k: v for k, v in found.items() if v} == {}


def _private_modules() -> set[str]:
    """Short names of the package's private modules (``_launch``, ``_policy``, ...)."""
    return {
        info.name.rsplit(".", 1)[1]
        for info in pkgutil.walk_packages(fsdp_guide.__path__, "fsdp_guide.")
        if info.name.rsplit(".", 1)[1].startswith("_") and info.name.count(".") >= 2
    }


def test_api_pages_do_not_list_private_modules(site: Path) -> None:  # noqa: F811
    private = _private_modules()
    assert {"_launch", "_policy", "_supervisor"} <= private
    found = {}
    for path in sorted((site / "api").glob("*.html")):
        code = set(re.findall(r'<span class="pre">(_\w+)</span>', path.read_text("utf-8")))
        if code & private:
            found[path.name] = sorted(code & private)
    assert found == {}


#: Pages written for contributors: "How a lesson is written" must say where figures are drawn.
CONTRIBUTOR_PAGES = {"lessons.html"}


def test_no_maintainer_notes_on_a_reader_page(site: Path) -> None:  # noqa: F811
    found = [
        (str(p.relative_to(site)), word)
        for p in reader_pages(site)
        if p.name not in CONTRIBUTOR_PAGES
        for word in MAINTAINER_WORDS
        if word in article_text(p)
    ]
    assert found == []


# -- item 5: the checkpoint API page leads with what to call ------------------------------


def test_checkpoint_page_leads_with_what_to_call(site: Path) -> None:  # noqa: F811
    text = (site / "api" / "fsdp_guide.checkpoint.html").read_text("utf-8")
    before = article_text_of(text[: text.find('<dt class="sig sig-object py"')])
    words = before.split()
    # save and load are named in the opening lines, and the signatures follow soon.
    assert "save()" in words[:40] and "load()" in words[:40], words[:40]
    assert len(words) < 330, f"{len(words)} words before the first signature"
    assert (site / "guide" / "checkpoints.html").exists()


def article_text_of(fragment: str) -> str:
    start = fragment.find("<article")
    fragment = fragment[start:] if start >= 0 else fragment
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


# -- item 10: primary sources --------------------------------------------------------------

PRIMARY_SOURCES = {
    "ZeRO": "https://arxiv.org/abs/1910.02054",
    "ZeRO-Offload": "https://arxiv.org/abs/2101.06840",
    "ZeRO-Infinity": "https://arxiv.org/abs/2104.07857",
    "PyTorch FSDP paper": "https://arxiv.org/abs/2304.11277",
    "FSDP2": "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html",
    "DCP": "https://docs.pytorch.org/docs/stable/distributed.checkpoint.html",
    "tensor parallelism": "https://docs.pytorch.org/docs/stable/distributed.tensor.parallel.html",
    "Lightning": "https://lightning.ai/docs/pytorch/stable/",
    "DeepSpeed": "https://deepspeed.readthedocs.io/en/latest/",
}


def _external_links(path: Path) -> set[str]:
    return {url for _, url in page(path).links if url.startswith("http")}


@pytest.mark.parametrize("name", sorted(PRIMARY_SOURCES))
def test_primary_source_is_linked(site: Path, name: str) -> None:  # noqa: F811
    url = PRIMARY_SOURCES[name]
    where = [str(p.relative_to(site)) for p in reader_pages(site) if any(
        link.startswith(url) for link in _external_links(p)
    )]  # fmt: skip
    assert where, f"no page links {name} ({url})"


@pytest.mark.parametrize(
    ("api_page", "source"),
    [
        ("fsdp_guide.memory", "ZeRO"),
        ("fsdp_guide.wrap", "FSDP2"),
        ("fsdp_guide.checkpoint", "DCP"),
        ("fsdp_guide.deepspeed", "DeepSpeed"),
        ("fsdp_guide.strategies", "Lightning"),
    ],
)
def test_api_page_links_the_source_of_its_facts(site: Path, api_page: str, source: str) -> None:  # noqa: F811
    links = _external_links(site / "api" / f"{api_page}.html")
    assert any(link.startswith(PRIMARY_SOURCES[source]) for link in links), sorted(links)


# -- item 11: the FSDP timeline, readable, for lesson 04 ----------------------------------

TIMELINE = REPO / "notebooks" / "figures" / "04_unit_timeline.svg"


def test_timeline_labels_are_readable_on_a_lesson_page() -> None:
    svg = TIMELINE.read_text(encoding="utf-8")
    width = float(re.search(r'viewBox="0 0 ([\d.]+)', svg).group(1))  # type: ignore[union-attr]
    sizes = [float(s) for s in re.findall(r"font-size: ([\d.]+)px", svg)]
    assert sizes, "labels are drawn as paths: keep text as text (svg.fonttype none)"
    # Shown at most 700 px wide in a lesson (no wider than drawn): smallest label >= 11 px.
    scale = min(1.0, 700 / width)
    assert min(sizes) * scale >= 11, (min(sizes), width)
    assert {"block 0", "reduce-scatter", "all-gather"} <= set(re.findall(r">([\w -]+)</", svg))


def test_the_glossary_no_longer_carries_the_small_timeline(site: Path) -> None:  # noqa: F811
    # The figure's file, not any "timeline" (fsdp_guide.timeline's API page may be linked).
    links = page(site / "guide" / "glossary.html").links
    assert not any(TIMELINE.stem in url for _, url in links)
    # The site's copy of the lessons has the figure beside it, where lesson 04 will point.
    assert (REPO / "docs" / "notebooks" / "figures" / TIMELINE.name).exists()


# -- issue 23: API pages from the façades' __all__ ----------------------------------------


def test_every_public_module_is_listed_on_the_api_index() -> None:
    listed = set(
        re.findall(r"^   (fsdp_guide[\w.]*)$", (REPO / "docs/api/index.rst").read_text(), re.M)
    )
    modules = {"fsdp_guide"} | {
        info.name
        for info in pkgutil.walk_packages(fsdp_guide.__path__, "fsdp_guide.")
        if not any(part.startswith("_") for part in info.name.split("."))
    }
    assert modules - listed == set(), "add these to docs/api/index.rst"


def test_each_facade_name_is_documented_once_in_full(site: Path) -> None:  # noqa: F811
    """A name of several façades has one full entry; the others link to it."""
    seen: dict[int, list[str]] = {}
    for path in sorted((site / "api").glob("fsdp_guide*.html")):
        module = importlib.import_module(path.stem)
        for sig_id in re.findall(r'<dt class="sig sig-object py" id="([\w.]+)"', path.read_text()):
            owner, _, name = sig_id.rpartition(".")
            if owner == path.stem and name in getattr(module, "__all__", []):
                seen.setdefault(id(getattr(module, name)), []).append(sig_id)
    twice = [ids for ids in seen.values() if len(ids) > 1]
    assert twice == []


def test_no_comment_for_maintainers_in_a_page_source() -> None:
    """A MyST ``%`` comment or an HTML comment is not shown, but the page's source is
    published next to it (and an HTML comment is copied into the page): notes on how a page
    is made belong in the script that makes it."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    skip = {"_build", "_generated"}
    found = []
    for path in sorted(docs.rglob("*.md")):
        if skip & set(path.relative_to(docs).parts):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            marker = line.startswith(":start-after:") or line.startswith(":end-before:")
            if line.startswith("%") or ("<!--" in line and not marker):
                found.append(f"{path.relative_to(docs)}:{number}")
    assert found == []
