"""The shape of the package stays as docs/architecture.md describes it."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import pytest

import fsdp_guide

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_guide"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _is_private(path: Path) -> bool:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return any(p.startswith("_") and p not in ("__init__", "__main__") for p in parts)


def _all_names(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            assert isinstance(node.value, ast.List)
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _sub_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def _concerns_row(sub_package: str) -> str:
    """The row of ``sub_package`` in docs/architecture.md's table of concerns."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## Where each concern lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith(f"| `{sub_package}/` |")]
    assert len(rows) == 1, f"docs/architecture.md has {len(rows)} rows for {sub_package}/"
    return rows[0]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_states_its_one_concept(path: Path) -> None:
    """One concept per file, however long: the module says which, and so does the page.

    Its docstring's first line names the concept; a module of a sub-package is named in
    that sub-package's row of docs/architecture.md, which says what each file holds. A file
    is not split because it grew (two halves of one idea read worse than one long file),
    and two ideas do not share one.
    """
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{path.name} has no docstring saying what it holds"
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 2 and path.name not in ("__init__.py", "__main__.py"):
        assert f"`{path.name}`" in _concerns_row(parts[0]), (
            f"docs/architecture.md's row for {parts[0]}/ does not say what {path.name} holds"
        )


def test_only_public_modules_declare_all() -> None:
    private_with_all = [
        str(p.relative_to(ROOT)) for p in SOURCES if _is_private(p) and _all_names(p)
    ]
    assert not private_with_all


def test_every_error_class_lives_in_errors_py() -> None:
    elsewhere = []
    for path in SOURCES:
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Timeout")):
                elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not elsewhere


def test_error_classes_keep_built_in_bases() -> None:
    from fsdp_guide import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        builtin = [b for b in cls.__mro__[1:] if b.__module__ == "builtins" and b is not object]
        assert builtin and builtin[0] is not BaseException, name


def test_no_public_name_shadows_a_module() -> None:
    for info in pkgutil.walk_packages(fsdp_guide.__path__, prefix="fsdp_guide."):
        parent_name, _, child = info.name.rpartition(".")
        parent = importlib.import_module(parent_name)
        value = getattr(parent, child, None)
        assert value is None or isinstance(value, types.ModuleType), (
            f"{parent_name}.{child} is a {type(value).__name__}, hiding the module {info.name}"
        )


@pytest.mark.parametrize(
    "facade", ["fsdp_guide", *(f"fsdp_guide.{name}" for name in _sub_packages())]
)
def test_facade_names_exist_and_are_documented(facade: str) -> None:
    module = importlib.import_module(facade)
    assert module.__doc__, f"{facade} has no docstring"
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{facade}.{name} has no docstring"


def test_architecture_page_names_every_sub_package() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [name for name in _sub_packages() if f"`{name}/`" not in page]
    assert not missing, f"docs/architecture.md does not describe {missing}"
