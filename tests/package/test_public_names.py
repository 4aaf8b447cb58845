"""The public API is what readers and users call, and it stays small.

Public is every entry of every ``__all__``: what the lessons import, what the guide pages,
the README and the examples name, the command line, and the documented extension points
(an engine, a wrap policy, a Lightning strategy). Everything else is private: a ``_`` module,
or a name importable from a façade for the package's other sub-packages but not in its
``__all__``. Read from the sources with ``ast``, so nothing is imported to count.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_guide"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: The most entries all ``__all__`` lists may hold together.
MOST_PUBLIC_NAMES = 100


@functools.cache
def all_entries(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Each module's ``__all__`` (a literal list), by dotted module name."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert node.value is not None
                names = ast.literal_eval(node.value)
                module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
                found[module.removesuffix(".__init__")] = list(names)
    return found


def test_the_public_names_are_few() -> None:
    entries = all_entries()
    total = sum(len(names) for names in entries.values())
    largest = sorted(entries.items(), key=lambda item: -len(item[1]))[:3]
    assert total <= MOST_PUBLIC_NAMES, (
        f"{total} public names (entries in every __all__), more than {MOST_PUBLIC_NAMES}; "
        f"largest: {[(module, len(names)) for module, names in largest]}. Make public only "
        "what a lesson, a guide page, the command line or an extension point needs"
    )


def test_the_count_reads_every_kind_of_all(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('__all__ = ["a", "b"]\n')
    (package / "sub" / "__init__.py").write_text('__all__: list[str] = ["c"]\n')
    (package / "sub" / "_private.py").write_text("__all__: list[str] = []\n")
    assert all_entries(package) == {"pkg": ["a", "b"], "pkg.sub": ["c"], "pkg.sub._private": []}


@functools.cache
def _lesson_imports() -> list[tuple[str, str, str]]:
    """``(lesson, module, name)`` for every ``from fsdp_guide... import name`` of the lessons."""
    found = []
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_guide"):
                found += [(notebook.stem, node.module, alias.name) for alias in node.names]
    return found


def _source(module: str) -> Path:
    path = ROOT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _public(module: str, name: str) -> bool:
    """Whether ``module.name`` is in the ``__all__`` of ``module``, or of the public module it
    comes from (an error class that a façade also lets the lessons import)."""
    if name in all_entries().get(module, []):
        return True
    if _source(f"{module}.{name}").exists():
        return True  # a public module
    for node in ast.parse(_source(module).read_text()).body:
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            origin = node.module or ""
            return not re.search(r"\._", origin) and _public(origin, name)
    return False


def _imported_names() -> list[tuple[str, str]]:
    return sorted({(module, name) for _, module, name in _lesson_imports()})


@pytest.mark.parametrize(
    ("module", "name"), _imported_names(), ids=[f"{m}.{n}" for m, n in _imported_names()]
)
def test_every_name_a_lesson_imports_is_public(module: str, name: str) -> None:
    lessons = sorted({lesson for lesson, m, n in _lesson_imports() if (m, n) == (module, name)})
    assert _public(module, name), f"{lessons} import {module}.{name}, which is not public"


@pytest.mark.parametrize(
    ("module", "name"), _imported_names(), ids=[f"{m}.{n}" for m, n in _imported_names()]
)
def test_every_name_a_lesson_imports_resolves(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"


#: A name in a bullet of a lesson's own "## API used" section (docs/lessons.md).
API_NAME = re.compile(r"`(fsdp_guide(?:\.\w+)+)`")


@functools.cache
def _api_section_names() -> list[tuple[str, str]]:
    """``(module, name)`` of every ``fsdp_guide...`` a lesson's "API used" section names."""
    found = set()
    for notebook in NOTEBOOKS:
        cells = json.loads(notebook.read_text())["cells"]
        for cell in cells:
            text = "".join(cell["source"])
            if cell["cell_type"] != "markdown" or not re.search(r"^## API used", text, re.M):
                continue
            for line in re.findall(r"^[-*] .*$", text, re.M):
                for dotted in API_NAME.findall(line):
                    if not _source(dotted).exists():  # a module, named as such
                        found.add(tuple(dotted.rsplit(".", 1)))
    return sorted(found)


@pytest.mark.parametrize(
    ("module", "name"), _api_section_names(), ids=[f"{m}.{n}" for m, n in _api_section_names()]
)
def test_every_name_a_lessons_api_section_lists_is_public(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module} has no {name}"
    assert _public(module, name), f"a lesson's API section names {module}.{name}, not public"


def test_the_lessons_import_names_at_all() -> None:
    pairs = _lesson_imports()
    assert len({(m, n) for _, m, n in pairs}) > 50
    assert not [m for _, m, _ in pairs if re.search(r"\._", m)], "a lesson imports a private module"


def test_the_check_follows_a_re_export() -> None:
    assert _public("fsdp_guide.checkpoint", "CheckpointError")  # documented in errors
    assert not _public("fsdp_guide.engines", "engine_class")  # for the package only
