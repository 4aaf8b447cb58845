"""Cross-links between the lessons and the API reference, found in the lessons' own imports.

Each lesson page ends with the API it uses (every ``fsdp_guide`` name its code imports, linked
to its reference entry), and each API page lists the lessons that import from it. Both are
computed from the notebooks at build time, so a lesson that starts using a helper is linked
without anyone editing a list.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import Any

from fsdp_refs import public_home

HEADING = "API used in this lesson"


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
    """The API page (a public module) that documents ``module.name``.

    Examples:
        >>> documented_on("fsdp_guide", "launch"), documented_on("fsdp_guide.wrap", "")
        ('fsdp_guide.launcher', 'fsdp_guide.wrap')
    """
    if not name:
        return module
    value = getattr(importlib.import_module(module), name, None)
    if isinstance(value, type(importlib)):  # a sub-module imported by name
        return str(value.__name__)
    origin = getattr(value, "__module__", None)
    home = public_home(origin) if isinstance(origin, str) else module
    return home if home.startswith("fsdp_guide") else module


def with_api_section(notebook: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``notebook`` ending with a Markdown cell that links every name it imports."""
    imports = lesson_imports(notebook)
    if not imports:
        return notebook
    items = []
    for module, name in imports:
        if name:
            items.append(f"- {{py:obj}}`{module}.{name}`")
        else:
            items.append(f"- {{doc}}`{module} </api/{module}>`")
    cell = {
        "cell_type": "markdown",
        "id": "fsdp-guide-api-links",
        "metadata": {},
        "source": f"## {HEADING}\n\nReference pages of what this lesson imports:\n\n"
        + "\n".join(items)
        + "\n",
    }
    return {**notebook, "cells": [*notebook.get("cells", []), cell]}


def lessons_by_page(notebooks: list[Path], titles: dict[str, str]) -> dict[str, list[str]]:
    """For each API page (module name), MyST links to the lessons that use what it documents."""
    pages: dict[str, list[str]] = {}
    for path in notebooks:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        link = f"{{doc}}`{titles.get(path.stem, path.stem)} </notebooks/{path.stem}>`"
        for page in sorted({documented_on(m, n) for m, n in lesson_imports(notebook)}):
            pages.setdefault(page, []).append(link)
    return pages


def lessons_section(links: list[str]) -> str:
    """The ``Used in the lessons`` section of an API page."""
    if not links:
        return ""
    return "\n## Used in the lessons\n\n" + "\n".join(f"- {link}" for link in links) + "\n"
