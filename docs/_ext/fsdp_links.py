"""Lesson <-> API cross-links, and the order of an API page, found in the code itself.

Each lesson page ends with the API it uses (every ``fsdp_guide`` name its code imports, linked
to its reference entry), and each API page lists the lessons that import from it
(``{lessons-using}``). Both are computed from the notebooks at build time, so a lesson that
starts using a helper is linked without anyone editing a list. No standard extension does
this; autosummary writes the API pages themselves (``docs/_templates/autosummary/``) from
:func:`api_context`: what each page documents, read from the façade's ``__all__``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import pkgutil
import re
from pathlib import Path
from typing import Any

HEADING = "API used in this lesson"
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def lesson_imports(notebook: dict[str, Any]) -> list[tuple[str, str]]:
    """``(module, name)`` for each ``from fsdp_guide... import name`` in the code cells.

    ``import fsdp_guide.x`` gives ``("fsdp_guide.x", "")``: the module itself.

    Examples:
        >>> cell = {"cell_type": "code", "source": "from fsdp_guide.wrap import shard, describe"}
        >>> lesson_imports({"cells": [cell]})
        [('fsdp_guide.wrap', 'describe'), ('fsdp_guide.wrap', 'shard')]
    """
    found: set[tuple[str, str]] = set()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        # Magics (%load_ext, %%distributed) are not Python; drop those lines.
        text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("%"))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_guide"):
                found.update((node.module or "", alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(
                    (alias.name, "") for alias in node.names if alias.name.startswith("fsdp_guide")
                )
    return sorted(found)


def documented_on(module: str, name: str) -> str:
    """The API page that documents ``module.name`` in full (``module`` itself for ``""``).

    Examples:
        >>> documented_on("fsdp_guide", "launch"), documented_on("fsdp_guide.wrap", "")
        ('fsdp_guide.launcher', 'fsdp_guide.wrap')
        >>> documented_on("fsdp_guide.strategies", "sharded")
        'fsdp_guide.strategies.sharded'
    """
    value = getattr(importlib.import_module(module), name, None) if name else None
    if not name or inspect.ismodule(value):
        return value.__name__ if inspect.ismodule(value) else module
    return home_page(module, name, _modules())


@functools.cache
def _modules() -> list[str]:
    return public_modules()


#: A lesson's own section (``docs/lessons.md``): ``## API used``, then a bullet per name,
#: ``- `fsdp_guide.module.name`: what it did here``.
LESSON_HEADING = re.compile(r"^## API used\b.*$", re.MULTILINE)
API_BULLET = re.compile(r"^[-*] .*$", re.MULTILINE)
API_NAME = re.compile(r"`(?P<dotted>fsdp_guide(?:\.\w+)*)`")


def _split_dotted(dotted: str) -> tuple[str, str]:
    """``(module, name)`` of a dotted path: the longest importable module, then one name.

    Examples:
        >>> _split_dotted("fsdp_guide.memory.plan"), _split_dotted("fsdp_guide.wrap")
        (('fsdp_guide.memory', 'plan'), ('fsdp_guide.wrap', ''))
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        rest = parts[cut:]
        if not rest:
            return module.__name__, ""
        if len(rest) == 1 and hasattr(module, rest[0]):
            return module.__name__, rest[0]
        break
    raise ValueError(f"{dotted} is not a public name of fsdp_guide: name it where it lives")


def _reference(module: str, name: str, shown: str = "") -> str:
    """A MyST link to the reference entry of ``module.name`` (its module page for ``""``)."""
    page = documented_on(module, name)
    value = getattr(importlib.import_module(module), name, None) if name else None
    if name and not inspect.ismodule(value):
        target = f"{page}.{name}"
        return (
            f"{{py:obj}}`{shown} <{target}>`"
            if shown and shown != target
            else (f"{{py:obj}}`{target}`")
        )
    return f"{{doc}}`{shown or page} </api/{page}>`"


def with_api_section(notebook: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``notebook`` whose "API used" section links every name it names and imports.

    A lesson that has its own ``## API used`` section keeps it, each name of its bullets turned
    into a link to its reference entry (the text after it stays), and the names it imports
    but does not list added as bullets; a name no public module has is an error. A notebook
    without that section gets one at its end, listing what it imports. Either way the page
    has one API section, never two.
    """
    imports = lesson_imports(notebook)
    cells = list(notebook.get("cells", []))
    own = next(
        (
            i
            for i, cell in enumerate(cells)
            if cell.get("cell_type") == "markdown" and LESSON_HEADING.search(_text(cell))
        ),
        None,
    )
    if own is not None:
        text = _text(cells[own])
        named = [m["dotted"] for b in API_BULLET.findall(text) for m in API_NAME.finditer(b)]
        listed = {_split_dotted(dotted) for dotted in named}

        def link(match: re.Match[str]) -> str:
            module, name = _split_dotted(match["dotted"])
            return _reference(module, name, match["dotted"])

        def link_names(bullet: re.Match[str]) -> str:
            return API_NAME.sub(link, bullet.group(0))

        text = API_BULLET.sub(link_names, text).rstrip("\n")
        # What the lesson imports under another path counts as listed when it is the same object.
        listed_objects = {id(_value(m, n)) for m, n in listed}
        extra = [
            f"- {_reference(m, n, f'{m}.{n}' if n else m)}"
            for m, n in imports
            if (m, n) not in listed and id(_value(m, n)) not in listed_objects
        ]
        cells[own] = {**cells[own], "source": "\n".join([text, *extra]) + "\n"}
        return {**notebook, "cells": cells}
    if not imports:
        return notebook
    items = [f"- {_reference(m, n)}" for m, n in imports]
    cell = {
        "cell_type": "markdown",
        "id": "fsdp-guide-api-links",
        "metadata": {},
        "source": f"## {HEADING}\n\nReference pages of what this lesson imports:\n\n"
        + "\n".join(items)
        + "\n",
    }
    return {**notebook, "cells": [*cells, cell]}


def _text(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _value(module: str, name: str) -> Any:
    imported = importlib.import_module(module)
    return getattr(imported, name) if name else imported


def notebook_title(path: Path) -> str:
    """First markdown heading of a notebook, else its file name."""
    for cell in json.loads(path.read_text(encoding="utf-8")).get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        source = cell.get("source", "")
        for line in ("".join(source) if isinstance(source, list) else source).splitlines():
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return path.stem


def lessons_using(page: str, notebooks: Path = NOTEBOOKS) -> list[tuple[str, str]]:
    """``(stem, title)`` of each lesson that imports something the API page ``page`` documents."""
    found = []
    for path in sorted(notebooks.glob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        if page in {documented_on(m, n) for m, n in lesson_imports(notebook)}:
            found.append((path.stem, notebook_title(path)))
    return found


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


def _documented_data(module: Any, name: str) -> bool:
    """Whether ``name`` has a ``#:`` comment in the module that defines or re-exports it."""
    from sphinx.pycode import ModuleAnalyzer

    try:
        return ("", name) in ModuleAnalyzer.for_module(module.__name__).find_attr_docs()
    except Exception:  # no source to analyse
        return False


def public_modules(package: str = "fsdp_guide") -> list[str]:
    """The package and every sub-module without a ``_``-prefixed part: one API page each."""
    root = importlib.import_module(package)

    def fail(name: str) -> None:
        raise ImportError(f"cannot import {name} to document it; fix the import error above")

    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}.", onerror=fail):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def public_home(module: str) -> str:
    """The public module that owns what ``module`` defines: the part before any ``_`` name.

    Examples:
        >>> public_home("fsdp_guide.memory._state"), public_home("fsdp_guide.errors")
        ('fsdp_guide.memory', 'fsdp_guide.errors')
    """
    parts = module.split(".")
    first_private = next((i for i, p in enumerate(parts) if p.startswith("_")), len(parts))
    return ".".join(parts[:first_private])


def home_page(module_name: str, name: str, modules: list[str]) -> str:
    """The API page that documents ``module_name.name`` in full.

    An object is documented once, on the page of the façade that owns its defining module
    (``fsdp_guide.memory`` for what ``fsdp_guide.memory._plan`` defines) when that façade
    exports it; every other module exporting it links there. Whatever it is not owned by a
    façade that exports it is documented where it is exported.
    """
    value = getattr(importlib.import_module(module_name), name)
    origin = getattr(value, "__module__", None)
    if inspect.ismodule(value):
        return module_name
    if not isinstance(origin, str):
        # Data does not know where it was defined: the most specific public module that
        # exports the same object owns it (``strategies.registry`` over ``strategies``).
        owners = [
            m
            for m in modules
            if name in getattr(importlib.import_module(m), "__all__", [])
            and getattr(importlib.import_module(m), name) is value
        ]
        return max(owners, key=lambda m: m.count("."), default=module_name)
    home = public_home(origin)
    exported = home in modules and name in getattr(importlib.import_module(home), "__all__", [])
    return home if exported else module_name


def _entry(module: Any, name: str) -> str:
    value = getattr(module, name)
    target = f"{module.__name__}.{name}"
    if inspect.isclass(value):
        return (
            f".. autoclass:: {target}\n   :members:\n   :undoc-members:\n"
            "   :show-inheritance:\n   :member-order: bysource\n"
        )
    if inspect.isroutine(value):
        return f".. autofunction:: {target}\n"
    if _documented_data(module, name):
        return f".. autodata:: {target}\n"
    shown = repr(value).replace("typing.", "")
    return f".. py:data:: {name}\n   :module: {module.__name__}\n   :value: {shown}\n"


def api_page(module_name: str, modules: list[str]) -> dict[str, Any]:
    """What the API page of ``module_name`` shows (autosummary's page template reads it).

    ``entries``: the reST of each name of the module's ``__all__`` documented here, in
    reading order, under the name the reader imports it by; ``short``: the functions and
    classes among them, for the summary table;
    ``elsewhere``: ``(name, page)`` of the names documented on their owner's page;
    ``lessons``: ``(notebook stem, title)`` of the lessons importing from this page. Read
    from ``__all__`` and the notebooks at every build, so moving a name between private
    modules or façades, or a lesson's new import, needs no edit of the docs.
    """
    module = importlib.import_module(module_name)
    entries, short, elsewhere = [], [], []
    names = [n for n in getattr(module, "__all__", []) if not inspect.ismodule(getattr(module, n))]
    for name in reading_order(module_name, names):
        home = home_page(module_name, name, modules)
        if home != module_name:
            elsewhere.append((name, home))
        else:
            entries.append(_entry(module, name))
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isroutine(value):
                short.append(name)  # a summary line of data would be its type's docstring
    return {
        "entries": entries,
        "short": short,
        "elsewhere": elsewhere,
        "lessons": lessons_using(module_name),
    }


def api_context(package: str = "fsdp_guide") -> dict[str, Any]:
    """``{"api": {module: api_page(module)}}``: plain data, so Sphinx can cache the config."""
    modules = public_modules(package)
    return {"api": {name: api_page(name, modules) for name in modules}}


def setup(app: Any) -> dict[str, Any]:
    """Nothing to register: conf.py hands :func:`api_context` to autosummary."""
    return {"parallel_read_safe": True, "parallel_write_safe": True}
