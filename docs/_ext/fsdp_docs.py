"""Sphinx extension that mirrors into the site what no standard extension reaches.

Sphinx reads sources only inside ``docs/``; the lessons and the benchmark results live
elsewhere in the repository. Before Sphinx reads the sources (``builder-inited``) this
writes (git-ignored, rewritten only when their content changes):

* ``docs/notebooks/``: a copy of every ``notebooks/NN_topic.ipynb`` whose "API used" section
  links the API it names and imports (``fsdp_links.py``) and whose links into ``docs/``
  land on the site (:func:`site_links`), and an index in lesson order;
* ``docs/_generated/results/<name>.md``: each ``benchmarks/results/<name>.md`` without its
  title (the page that includes it gives its own), a placeholder for a result a page
  includes that is not committed yet, and ``docs/_generated/benchmarks.md`` gathering them;
* ``docs/_generated/will_it_fit_table.md``: the planner's table for the guide, planned at
  build time (``fsdp_fit.py``, cached while the planner's code is unchanged).

The rest is standard: autosummary writes the API pages from each façade's ``__all__``,
sphinx-argparse the command line reference, and sphinxcontrib-programoutput runs the
commands whose output the CLI page shows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fsdp_fit import generate_fit_table
from fsdp_links import notebook_title, with_api_section

DOCS_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = DOCS_DIR.parent
# A notebook is a lesson when its name starts with its number: 01_topic.ipynb.
LESSON_NAME = re.compile(r"^\d+_[A-Za-z0-9_]+\.ipynb$")
# Guide pages pull a measured table in with ``{include} /_generated/results/NAME.md``
# (a leading ``/`` means the docs folder).
RESULT_INCLUDE = re.compile(r"_generated/results/([A-Za-z0-9_]+)\.md")
# A lesson links a page of the site the way Jupyter finds it beside the repository's docs/:
# ``[reduce-scatter](../docs/guide/glossary.md#term-reduce-scatter)``.
DOCS_LINK = re.compile(
    r"\[(?P<text>[^\]]+)\]\(\.\./docs/(?P<path>[^)#\s]+)(?:#(?P<anchor>[^)\s]+))?\)"
)
GLOSSARY_PAGE = "guide/glossary.md"
# A result's figure, linked beside its table: ``![what it shows](name.svg)``.
RESULT_FIGURE = re.compile(r"\]\(([A-Za-z0-9_]+\.svg)\)")


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` unless it already holds exactly that; return whether written."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def write_bytes_if_changed(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` unless it already holds exactly that."""
    if not (path.exists() and path.read_bytes() == data):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def glossary_terms(glossary: str) -> dict[str, str]:
    """Each term of the ``{glossary}`` block of ``glossary`` (MyST), by its anchor's slug.

    Sphinx gives a term the id ``term-`` + the term with every run of other characters than
    letters, digits, ``.`` and ``_`` turned into ``-``; the slug here is that id, lowercased.

    Examples:
        >>> glossary_terms("```{glossary}\\n:sorted:\\n\\nmodel state\\n  Text.\\n```\\n")
        {'term-model-state': 'model state'}
    """
    found: dict[str, str] = {}
    block = re.search(r"^```\{glossary\}\n(.*?)^```", glossary, re.DOTALL | re.MULTILINE)
    for line in block.group(1).splitlines() if block else []:
        if line.strip() and not line[0].isspace() and not line.startswith(":"):
            term = line.strip()
            slug = re.sub(r"[^A-Za-z0-9._]+", "-", term).strip("-").lower()
            found[f"term-{slug}"] = term
    return found


def site_links(markdown: str, terms: dict[str, str]) -> str:
    """``markdown`` of a lesson with its links into ``../docs/`` made to work on the site.

    The site's copy of a lesson sits in ``docs/notebooks/``, so ``../docs/x.md`` becomes
    ``../x.md``; a link to a glossary entry becomes the ``{term}`` role, which lands on the
    entry (a Markdown link to another page's ``#term-...`` anchor does not resolve). A link
    to a term the glossary lacks is an error naming it.

    Examples:
        >>> site_links("[reduce-scatters](../docs/guide/glossary.md#term-reduce-scatter)",
        ...            {"term-reduce-scatter": "reduce-scatter"})
        '{term}`reduce-scatters <reduce-scatter>`'
        >>> site_links("[the CLI](../docs/cli.md)", {})
        '[the CLI](../cli.md)'
    """

    def rewrite(match: re.Match[str]) -> str:
        text, path, anchor = match["text"], match["path"], match["anchor"]
        if path == GLOSSARY_PAGE and anchor and anchor.lower().startswith("term-"):
            term = terms.get(anchor.lower())
            if term is None:
                raise ValueError(
                    f"the link [{text}](../docs/{path}#{anchor}) names no term of the glossary; "
                    f"add the term to docs/{GLOSSARY_PAGE} or link one of {sorted(terms)}"
                )
            shown = text.replace("<", "\\<").replace("`", "")
            return f"{{term}}`{shown} <{term}>`"
        return f"[{text}](../{path}{'#' + anchor if anchor else ''})"

    return DOCS_LINK.sub(rewrite, markdown)


def for_the_site(notebook: dict[str, Any], terms: dict[str, str]) -> dict[str, Any]:
    """The site's copy of a lesson: links into ``docs/`` rewritten, its API section linked."""
    cells = []
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else source
            cell = {**cell, "source": site_links(text, terms)}
        cells.append(cell)
    return with_api_section({**notebook, "cells": cells})


def sync_notebooks(source_dir: Path, target_dir: Path, repository: str = "") -> list[str]:
    """Copy the lessons of ``source_dir`` into ``target_dir`` and write its index.

    Returns the copied file names in lesson order. A notebook whose name does not follow
    ``NN_topic.ipynb`` is an error: it would otherwise silently be left out of the site.
    """
    notebooks = sorted(source_dir.glob("*.ipynb")) if source_dir.is_dir() else []
    misnamed = [p.name for p in notebooks if not LESSON_NAME.match(p.name)]
    if misnamed:
        raise ValueError(
            f"notebooks {misnamed} are not named NN_topic.ipynb; rename them so the docs "
            "can place them in lesson order"
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in notebooks]
    for stale in target_dir.glob("*.ipynb"):
        if stale.name not in names:
            stale.unlink()
    glossary = target_dir.parent / GLOSSARY_PAGE
    terms = glossary_terms(glossary.read_text(encoding="utf-8")) if glossary.is_file() else {}
    for path in notebooks:
        # The copy links into the site and to the API it uses (the notebook stays as it is).
        notebook = json.loads(path.read_text(encoding="utf-8"))
        try:
            copy = for_the_site(notebook, terms)
        except ValueError as err:
            raise ValueError(f"{path.name}: {err}") from None
        write_if_changed(target_dir / path.name, json.dumps(copy, indent=1))
    # Figures a lesson shows (``figures/x.svg`` from the notebook) travel with the copies.
    figures = source_dir / "figures"
    if figures.is_dir():
        for figure in figures.iterdir():
            if figure.is_file():
                write_bytes_if_changed(target_dir / "figures" / figure.name, figure.read_bytes())
    if names:
        listing = "\n".join(f"1. [{notebook_title(p)}]({p.stem}.ipynb)" for p in notebooks)
        toctree = "\n".join(p.stem for p in notebooks)
        body = (
            "Each lesson is a notebook in the repository's `notebooks/` folder, shown here\n"
            "with the outputs of a real run (nothing is executed while the site builds).\n"
            "To run one yourself, [install fsdp-guide](../install.md), then download the\n"
            "notebook with the button at the top of its page, or take them all from\n"
            f"[the repository]({repository}/tree/main/notebooks).\n\n"
            f"{listing}\n\n```{{toctree}}\n:hidden:\n:maxdepth: 1\n\n{toctree}\n```\n"
        )
    else:
        body = "No lesson has been written yet: notebooks appear here as they land.\n"
    write_if_changed(target_dir / "index.md", f"# Lessons\n\n{body}")
    return names


def _split_title(text: str) -> tuple[str, str]:
    """The ``# title`` line of a result, and the text without it.

    Examples:
        >>> _split_title("# Launch overhead\\n\\n| a |\\n")
        ('Launch overhead', '\\n| a |\\n')
    """
    first, _, rest = text.partition("\n")
    if first.startswith("# "):
        return first[2:].strip(), rest
    return "", text


def generate_result_pages(results_dir: Path, generated_dir: Path, docs_dir: Path) -> list[str]:
    """Mirror benchmark results into ``generated_dir/results`` and gather them in one page.

    Every result that a guide page includes but that is not committed yet gets a
    placeholder saying which script writes it. Returns the names of committed results.
    """
    committed = sorted(p.stem for p in results_dir.glob("*.md")) if results_dir.is_dir() else []
    referenced: set[str] = set()
    for page in docs_dir.rglob("*.md"):
        if any(part in {"_build", "_generated"} for part in page.relative_to(docs_dir).parts):
            continue
        referenced.update(RESULT_INCLUDE.findall(page.read_text(encoding="utf-8")))
    out = generated_dir / "results"
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(committed) | referenced
    for stale in out.glob("*.md"):
        if stale.stem not in wanted:
            stale.unlink()
    titles: dict[str, str] = {}
    for name in sorted(wanted):
        if name in committed:
            # The page that includes a result gives it a heading of its own: drop the result's
            # title, or the reader sees the same heading twice.
            title, text = _split_title((results_dir / f"{name}.md").read_text(encoding="utf-8"))
            titles[name] = title or f"`{name}`"
            # A figure beside the table (``![...](name.svg)``, as the repository shows it)
            # is found from the docs folder, wherever the page including it sits.
            text = RESULT_FIGURE.sub(r"](/_generated/results/\1)", text)
        else:
            text = (
                "```{note}\n"
                f"Measured table pending: it appears here once `benchmarks/{name}.py` has\n"
                f"written `benchmarks/results/{name}.md` to the repository.\n"
                "```\n"
            )
        write_if_changed(out / f"{name}.md", text)
    # A result's figure (``![...](name.svg)`` in its table's page) travels with it.
    for figure in results_dir.glob("*.svg") if results_dir.is_dir() else []:
        write_bytes_if_changed(out / figure.name, figure.read_bytes())
    if committed:
        body = "\n".join(
            f"## {titles[name]}\n\nWritten by `benchmarks/{name}.py` to "
            f"`benchmarks/results/{name}.md`.\n\n"
            f"```{{include}} /_generated/results/{name}.md\n:heading-offset: 1\n```\n"
            for name in committed
        )
    else:
        body = "No benchmark result has been committed yet.\n"
    write_if_changed(generated_dir / "benchmarks.md", body)
    return committed


def generate_all(app: Any = None) -> None:
    """Regenerate every page above (connected to ``builder-inited``)."""
    repository = app.config.html_theme_options["repository_url"] if app else ""
    sync_notebooks(REPO_DIR / "notebooks", DOCS_DIR / "notebooks", repository)
    generate_result_pages(REPO_DIR / "benchmarks" / "results", DOCS_DIR / "_generated", DOCS_DIR)
    generate_fit_table(REPO_DIR, DOCS_DIR / "_generated" / "will_it_fit_table.md")


# Written into the output folder by a build that ended without a warning; the site tests
# rebuild when it is missing or older than a source (a --keep-going build that warned
# still writes every page, which must not pass for a good site).
CLEAN_BUILD_MARKER = ".fsdp-docs-clean-build"


def _forget_clean_build(app: Any) -> None:
    (Path(app.outdir) / CLEAN_BUILD_MARKER).unlink(missing_ok=True)


def _mark_clean_build(app: Any, exception: BaseException | None) -> None:
    warnings = getattr(app, "_warncount", None)  # private: unknown means not clean
    if exception is None and warnings == 0:
        (Path(app.outdir) / CLEAN_BUILD_MARKER).write_text("no warnings\n", encoding="utf-8")


def setup(app: Any) -> dict[str, Any]:
    """Register the generator with Sphinx."""
    app.connect("builder-inited", _forget_clean_build)
    app.connect("builder-inited", generate_all)
    app.connect("build-finished", _mark_clean_build)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
