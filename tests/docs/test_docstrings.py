"""Docstrings of the public API render as Napoleon reads them: one field list, real types.

Two mistakes showed on the API pages: prose placed after ``Args:`` ends the section, so the
parameters and return type were listed twice; and the first line of ``Returns:`` is split on
its first colon (outside roles and code), so a sentence with a colon became the "type".
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

import pytest

import fsdp_guide

SECTION = re.compile(
    r"^(Args|Arguments|Returns|Yields|Raises|Examples|Example|Note|Notes|Attributes|Warning"
    r"|Warnings|See Also|Todo):\s*$"
)
# Napoleon does not split on colons inside roles (:func:`a.b`) or inline code (``a: b``).
HIDES_COLONS = re.compile(r"``.+?``|(:[\w:.+-]+:)?`.+?`")


def public_objects() -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    modules = ["fsdp_guide"] + [
        info.name
        for info in pkgutil.walk_packages(fsdp_guide.__path__, "fsdp_guide.")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            # Data and type aliases are documented by ``#:`` comments, not docstrings.
            if id(obj) in seen or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            seen.add(id(obj))
            yield f"{module_name}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and (
                        inspect.isfunction(member) or isinstance(member, property)
                    ):
                        yield f"{module_name}.{name}.{attr}", member


def docstring_problems(doc: str) -> list[str]:
    """What Napoleon would misread in a Google-style docstring."""
    found = []
    section: str | None = None
    first_line = False
    for line in doc.splitlines():
        if SECTION.match(line):
            section, first_line = line.rstrip(": "), True
            continue
        if section is not None and line and not line.startswith(" "):
            found.append(f"prose after the {section} section: {line[:50]!r}")
            section = None
        if section in ("Returns", "Yields") and first_line and line.strip():
            head, colon, _ = HIDES_COLONS.sub("X", line.strip()).partition(":")
            if colon and " " in head.strip():
                found.append(f"{section} would read {head.strip()!r} as a type")
            first_line = False
    return found


def test_the_lint_finds_both_mistakes() -> None:
    doc = "Do it.\n\nArgs:\n    x: A thing.\n\nMore prose.\n\nReturns:\n    The result: a list.\n"
    assert docstring_problems(doc) == [
        "prose after the Args section: 'More prose.'",
        "Returns would read 'The result' as a type",
    ]
    fine = "Do it.\n\nReturns:\n    The measured :class:`ModelState`, ``a: b``.\n"
    assert docstring_problems(fine) == []


@pytest.mark.parametrize(("name", "obj"), list(public_objects()), ids=lambda v: str(v)[:60])
def test_public_docstrings_read_as_napoleon_reads_them(name: str, obj: Any) -> None:
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    assert docstring_problems(doc) == []
