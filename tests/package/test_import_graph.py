"""The import graph is the one docs/architecture.md draws, and façades are the only way in.

The graph is read from the sources with ``ast``: every ``fsdp_guide`` import of every module,
lazy ones inside functions included, since a lazy import is a dependency all the same.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_guide"
PAGE = ROOT / "docs" / "architecture.md"
SUB_PACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
LEAF_MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_"))


def _owner(path: Path) -> str:
    """``catalog`` for ``fsdp_guide/catalog/_table.py``; ``""`` for a top-level module."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every ``fsdp_guide`` module ``path`` imports, ``from X import _y`` too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fsdp_guide"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_guide"):
            assert node.module is not None
            yield node.lineno, node.module
            private_parent = any(p.startswith("_") for p in node.module.split(".")[1:])
            for alias in node.names:  # ``from fsdp_guide.memory import _measure``
                if alias.name.startswith("_") and not private_parent:
                    yield node.lineno, f"{node.module}.{alias.name}"


def _edges() -> set[tuple[str, str]]:
    """(importer, imported) between sub-packages."""
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        mine = _owner(path)
        for _, module in _imports(path):
            parts = module.split(".")
            theirs = parts[1] if len(parts) > 1 else ""
            if mine and theirs in SUB_PACKAGES and theirs != mine:
                edges.add((mine, theirs))
    return edges


def _section(title: str) -> str:
    text = PAGE.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no section {title!r}"
    return match.group(1)


def _layers() -> dict[str, int]:
    """Each sub-package of the layer picture and its height: 0 at the bottom."""
    block = re.search(r"```text\n(.*?)```", _section("The layers"), re.S)
    assert block, "the layers section has no text picture"
    rows = [
        [name for name in re.findall(r"(\w+)/", line) if name in SUB_PACKAGES]
        for line in block.group(1).splitlines()
    ]
    rows = [row for row in rows if row]
    return {name: len(rows) - i for i, row in enumerate(rows) for name in row}


def _documented_edges() -> set[tuple[str, str]]:
    """The rows of the 'Who imports whom' table: `a/` | `b/`, `c/`."""
    edges = set()
    for line in _section("Who imports whom").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        importer = cells[0].strip("`/")
        for imported in re.findall(r"`(\w+)/`", cells[1]):
            edges.add((importer, imported))
    return edges


def test_every_sub_package_is_in_the_picture_once() -> None:
    assert sorted(_layers()) == SUB_PACKAGES


def test_imports_point_down_the_picture() -> None:
    height = _layers()
    upward = sorted(f"{a} -> {b}" for a, b in _edges() if height[a] <= height[b])
    assert not upward, f"imports that do not point down docs/architecture.md's picture: {upward}"


def test_the_table_of_imports_is_the_code_s() -> None:
    documented, real = _documented_edges(), _edges()
    assert documented, "the 'Who imports whom' table has no rows"
    assert sorted(real - documented) == [], "imports the page does not list"
    assert sorted(documented - real) == [], "imports the page lists and the code lacks"


def test_the_catalog_is_a_leaf_and_launcher_knows_no_sub_package() -> None:
    assert {b for a, b in _edges() if a in ("catalog", "launcher")} == set()


def test_no_sub_package_reaches_into_another_s_private_modules() -> None:
    found = []
    for path in PACKAGE.rglob("*.py"):
        mine = _owner(path)
        for line, module in _imports(path):
            parts = module.split(".")
            private = any(p.startswith("_") and p != "__init__" for p in parts[1:])
            owner = parts[1] if len(parts) > 2 else ""
            # A private top-level module (``fsdp_guide._own_allocations``) is shared by the
            # sub-packages as errors.py is, with no façade to go through.
            shared = len(parts) == 2
            if private and owner != mine and not shared:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not found, "enter a sub-package through its façade:\n" + "\n".join(found)


def _all_names(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


def test_a_public_name_has_one_home() -> None:
    """No name is in the ``__all__`` of two sub-packages (``errors.py`` counts as one).

    A package re-exporting names of its own public modules is one place; ``fsdp_guide``
    itself re-exports a handful for notebooks, each from exactly one sub-package.
    """
    homes: dict[str, set[str]] = {}
    top: list[str] = []
    for path in PACKAGE.rglob("*.py"):
        owner = _owner(path) or path.stem
        if path == PACKAGE / "__init__.py":
            top = _all_names(path)
            continue
        for name in _all_names(path):
            homes.setdefault(name, set()).add(owner)
    several = {name: sorted(owners) for name, owners in homes.items() if len(owners) > 1}
    assert not several, f"names exported by several sub-packages: {several}"
    orphans = [name for name in top if name not in homes and name not in ("__version__",)]
    orphans = [n for n in orphans if n != "load_ipython_extension"]
    assert not orphans, f"the top level exports names no sub-package documents: {orphans}"


@pytest.mark.parametrize("name", SUB_PACKAGES)
def test_each_sub_package_has_a_row_in_the_table_of_concerns(name: str) -> None:
    assert f"| `{name}/` |" in _section("Where each concern lives")
