"""Sphinx extension that generates the pages which follow the repository's contents.

Nothing generated here is committed: it is rewritten on every build, before Sphinx reads
the sources (``builder-inited``), so a module, notebook, command or benchmark result added
to the repository appears in the site without editing a list by hand.

* ``docs/api/``: one page per public module of :mod:`fsdp_guide` (found by walking the
  package, skipping modules whose name starts with ``_``) and an index.
* ``docs/notebooks/``: a copy of every ``notebooks/NN_topic.ipynb`` (the notebooks stay
  in ``notebooks/``; the copy is git-ignored) and an index in lesson order.
* ``docs/_generated/cli.md``: ``--help`` of the command line and of every command,
  rendered from :func:`fsdp_guide.cli.build_parser`.
* ``docs/_generated/results/<name>.md``: each ``benchmarks/results/<name>.md``, plus a
  placeholder for every result a guide page includes that is not committed yet, and
  ``docs/_generated/benchmarks.md`` gathering all of them.
* ``docs/_generated/will_it_fit_table.md``: the planner's table for the guide
  (``fsdp_fit.py``, cached while the planner's code is unchanged).

Files are only rewritten when their content changes, so incremental builds stay cheap.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import pkgutil
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from fsdp_fit import generate_fit_table
from fsdp_links import lessons_by_page, lessons_section, with_api_section
from fsdp_refs import public_home

DOCS_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = DOCS_DIR.parent
PACKAGE = "fsdp_guide"
# A notebook is a lesson when its name starts with its number: 01_topic.ipynb.
LESSON_NAME = re.compile(r"^\d+_[A-Za-z0-9_]+\.ipynb$")
# Guide pages pull a measured table in with ``{include} /_generated/results/NAME.md``
# (a leading ``/`` means the docs folder).
RESULT_INCLUDE = re.compile(r"_generated/results/([A-Za-z0-9_]+)\.md")


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` unless it already holds exactly that; return whether written."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def _raise(name: str) -> None:
    raise ImportError(f"cannot import {name} to document it; fix the import error above")


def public_modules(package: str = PACKAGE) -> list[str]:
    """Names of the package and of every submodule without a ``_``-prefixed part, sorted."""
    root = importlib.import_module(package)
    names = [package]
    # walk_packages imports sub-packages to look inside; by default it would skip one that
    # fails to import, and its pages would silently vanish from the site.
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}.", onerror=_raise):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return sorted(names)


def public_names(module_name: str) -> list[str]:
    """The names a module documents: its ``__all__``, else what it defines without ``_``."""
    module = importlib.import_module(module_name)
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return list(declared)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module_name
    )


def defining_module(module_name: str, name: str, modules: list[str]) -> str | None:
    """The other public module that documents ``name`` of ``module_name``, if it is a re-export.

    A name counts as re-exported when its object was defined in another public module
    that lists it too; it is then documented once, there, and linked from here. An object
    defined in a private module (``fsdp_guide.memory._state``) is at home in the façade of
    its package (``fsdp_guide.memory``), which re-exports it.
    """
    value = getattr(importlib.import_module(module_name), name, None)
    origin = getattr(value, "__module__", None)
    if isinstance(origin, str):
        origin = public_home(origin)
    if not isinstance(origin, str) or origin == module_name or origin not in modules:
        return None
    return origin if name in public_names(origin) else None


def _data_entry(module: Any, name: str) -> str:
    """reST for module data: ``autodata`` when it has a ``#:`` comment, else its value.

    autodoc's member scan skips undocumented module data (type aliases, ``__version__``)
    and ``autodata`` would show the docstring of the value's class (``str``) instead.
    """
    from sphinx.pycode import ModuleAnalyzer

    try:
        documented = ("", name) in ModuleAnalyzer.for_module(module.__name__).find_attr_docs()
    except Exception:  # no source to analyse
        documented = False
    if documented:
        return f".. autodata:: {module.__name__}.{name}\n"
    value = repr(getattr(module, name)).replace("typing.", "")
    return f".. py:data:: {name}\n   :module: {module.__name__}\n   :value: {value}\n"


_MENTION = re.compile(r":(?:func|class|data|obj|meth|attr):`~?([\w.]+)`")


def reading_order(module_name: str, names: list[str]) -> list[str]:
    """``names`` in the order a reader wants them: the module docstring's own mentions first.

    A façade's docstring introduces its main functions first (``launcher``: ``launch``), so
    the names it mentions come first, in that order; then functions, classes and data, each
    in ``__all__`` order.
    """
    module = importlib.import_module(module_name)
    mentioned: list[str] = []
    for target in _MENTION.findall(module.__doc__ or ""):
        short = target.rsplit(".", 1)[-1]
        if short in names and short not in mentioned:
            mentioned.append(short)

    def kind(name: str) -> int:
        value = getattr(module, name)
        return 0 if inspect.isroutine(value) else 1 if inspect.isclass(value) else 2

    rest = sorted((n for n in names if n not in mentioned), key=lambda n: (kind(n), names.index(n)))
    return mentioned + rest


def _member_entry(module: Any, name: str) -> str:
    value = getattr(module, name)
    target = f"{module.__name__}.{name}"
    if inspect.isclass(value):
        return (
            f".. autoclass:: {target}\n   :members:\n   :undoc-members:\n"
            "   :show-inheritance:\n   :member-order: bysource\n"
        )
    if inspect.isroutine(value):
        return f".. autofunction:: {target}\n"
    return _data_entry(module, name)


def module_page(module_name: str, modules: list[str], lessons: list[str] | None = None) -> str:
    """MyST source of the API page of one module: its docstring, then its names in reading order."""
    own: list[str] = []
    reexported: list[tuple[str, str]] = []
    for name in public_names(module_name):
        origin = defining_module(module_name, name, modules)
        if origin is None:
            own.append(name)
        else:
            reexported.append((name, origin))
    module = importlib.import_module(module_name)
    rst = [f".. automodule:: {module_name}", "   :no-members:", ""]
    rst += [_member_entry(module, name) for name in reading_order(module_name, own)]
    page = f"# `{module_name}`\n\n```{{eval-rst}}\n" + "\n".join(rst) + "```\n"
    if reexported:
        rows = "\n".join(
            f"| `{name}` | {{py:obj}}`{origin}.{name}` |" for name, origin in reexported
        )
        page += (
            f"\n## Re-exported names\n\n"
            f"Also importable from `{module_name}`; documented where they are defined.\n\n"
            f"| Name | Documentation |\n| --- | --- |\n{rows}\n"
        )
    return page + lessons_section(lessons or [])


# The API index, for a reader: the modules most people import first, then the strategy
# table and the comparison, then what supports them. A module in none of these lists (a new
# one) is listed under "Other", so nothing public goes missing.
API_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Core",
        (
            "fsdp_guide.launcher",
            "fsdp_guide.memory",
            "fsdp_guide.comm",
            "fsdp_guide.wrap",
            "fsdp_guide.checkpoint",
            "fsdp_guide.strategies",
            "fsdp_guide.deepspeed",
        ),
    ),
    (
        "Strategies, comparison, command line",
        ("fsdp_guide.catalog", "fsdp_guide.engines", "fsdp_guide.compare", "fsdp_guide.cli"),
    ),
    (
        "Supporting modules",
        (
            "fsdp_guide",
            "fsdp_guide.errors",
            "fsdp_guide.models",
            "fsdp_guide.examples",
            "fsdp_guide.launcher.magic",
            "fsdp_guide.strategies.sharded",
            "fsdp_guide.strategies.fully_sharded",
            "fsdp_guide.strategies.registry",
        ),
    ),
)


def summary(module_name: str) -> str:
    """The first line of a module's docstring."""
    doc = (importlib.import_module(module_name).__doc__ or "").strip()
    first = doc.splitlines()[0] if doc else ""
    # reST roles mean nothing in a Markdown page: show their target as code.
    return re.sub(r":[\w:]+:`~?([^`]+)`", r"`\1`", first).replace("``", "`")


def api_index(modules: list[str]) -> str:
    """MyST source of the API index: the groups above, each module with its one-line summary."""
    listed = {name for _, names in API_GROUPS for name in names}
    groups = [(title, [n for n in names if n in modules]) for title, names in API_GROUPS]
    groups.append(("Other", [n for n in modules if n not in listed]))
    body = [
        "# API reference\n",
        "Every public name of `fsdp_guide`, one page per module, generated from the",
        "docstrings. Most code needs only the core modules. A name re-exported elsewhere",
        "(`from fsdp_guide import launch`) is documented once and linked from there.\n",
    ]
    order: list[str] = []
    for title, names in groups:
        if not names:
            continue
        body.append(f"## {title}\n")
        body += [f"- {{doc}}`{name}`: {summary(name)}" for name in names]
        body.append("")
        order += names
    toctree = "\n".join(order)
    body.append(f"```{{toctree}}\n:hidden:\n:maxdepth: 1\n\n{toctree}\n```\n")
    return "\n".join(body)


def generate_api_pages(
    api_dir: Path, package: str = PACKAGE, notebooks_dir: Path | None = None
) -> list[str]:
    """Write one page per public module and an index into ``api_dir``; return the modules.

    With ``notebooks_dir``, each page links to the lessons that import what it documents.
    """
    modules = public_modules(package)
    lessons = sorted(notebooks_dir.glob("*.ipynb")) if notebooks_dir is not None else []
    used_in = lessons_by_page(lessons, {p.stem: _notebook_title(p) for p in lessons})
    wanted = {f"{name}.md" for name in modules} | {"index.md"}
    api_dir.mkdir(parents=True, exist_ok=True)
    for stale in api_dir.glob("*.md"):
        if stale.name not in wanted:
            stale.unlink()
    for name in modules:
        write_if_changed(api_dir / f"{name}.md", module_page(name, modules, used_in.get(name)))
    write_if_changed(api_dir / "index.md", api_index(modules))
    return modules


def _notebook_title(path: Path) -> str:
    """First markdown heading of a notebook, else its file name."""
    import json

    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        for line in text.splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return path.stem


def sync_notebooks(source_dir: Path, target_dir: Path) -> list[str]:
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
    for path in notebooks:
        # The copy ends with links to the API it uses (the notebook itself stays as it is).
        notebook = json.loads(path.read_text(encoding="utf-8"))
        write_if_changed(target_dir / path.name, json.dumps(with_api_section(notebook), indent=1))
    if names:
        listing = "\n".join(f"1. [{_notebook_title(p)}]({p.stem}.ipynb)" for p in notebooks)
        toctree = "\n".join(p.stem for p in notebooks)
        body = (
            "Each lesson is a notebook in the repository's `notebooks/` folder, shown here\n"
            "with the outputs of a real run (nothing is executed while the site builds).\n"
            "Download one with the button at the top of its page and run it yourself.\n\n"
            f"{listing}\n\n```{{toctree}}\n:hidden:\n:maxdepth: 1\n\n{toctree}\n```\n"
        )
    else:
        body = "No lesson has been written yet: notebooks appear here as they land.\n"
    write_if_changed(target_dir / "index.md", f"# Lessons\n\n{body}")
    return names


def render_cli_help(parser: Any) -> str:
    """Markdown with the ``--help`` of ``parser`` and of each of its sub-commands."""
    import argparse

    def help_text(p: argparse.ArgumentParser) -> str:
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            p.print_help()
        return buffer.getvalue().rstrip()

    parts = [f"## `python -m {parser.prog}`\n\n```text\n{help_text(parser)}\n```\n"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(f"## `{name}`\n\n```text\n{help_text(sub)}\n```\n")
    return "\n".join(parts)


# What readers see run on the CLI page: commands cheap enough to run at every build.
CLI_EXAMPLES: tuple[tuple[str, ...], ...] = (
    ("estimate", "--params", "7e9", "--world-size", "8", "--gpu-memory", "80GB"),
    ("estimate", "--params", "70B", "--world-size", "64", "--precision", "mixed"),
    (
        "estimate",
        "--model",
        "fsdp_guide.models:TinyTransformer",
        "--batch-size",
        "8",
        "--world-size",
        "2",
        "--strategy",
        "ddp,zero1,fsdp_grad_op,fsdp,fsdp2",
        "--gpu-memory",
        "18MB",
    ),
)


def render_cli_examples() -> str:
    """Markdown with the real output of each command of :data:`CLI_EXAMPLES`."""
    from fsdp_guide.cli import main

    parts = []
    for argv in CLI_EXAMPLES:
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            status = main(list(argv))
        if status != 0:
            raise RuntimeError(f"python -m fsdp_guide {' '.join(argv)} exited with {status}")
        command = "python -m fsdp_guide " + " ".join(argv)
        parts.append(f"```console\n$ {command}\n{buffer.getvalue().rstrip()}\n```\n")
    return "\n".join(parts)


def generate_cli_page(target: Path) -> None:
    """Write the rendered help of every command of ``python -m fsdp_guide`` to ``target``,
    and the output of the examples beside it (``cli_examples.md``)."""
    from fsdp_guide.cli import build_parser

    write_if_changed(target, render_cli_help(build_parser()))
    write_if_changed(target.with_name("cli_examples.md"), render_cli_examples())


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
        else:
            text = (
                "```{note}\n"
                f"Measured table pending: it appears here once `benchmarks/{name}.py` has\n"
                f"written `benchmarks/results/{name}.md` to the repository.\n"
                "```\n"
            )
        write_if_changed(out / f"{name}.md", text)
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
    generated = DOCS_DIR / "_generated"
    generate_api_pages(DOCS_DIR / "api", notebooks_dir=REPO_DIR / "notebooks")
    sync_notebooks(REPO_DIR / "notebooks", DOCS_DIR / "notebooks")
    generate_cli_page(generated / "cli.md")
    generate_result_pages(REPO_DIR / "benchmarks" / "results", generated, DOCS_DIR)
    generate_fit_table(REPO_DIR, generated / "will_it_fit_table.md")


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
