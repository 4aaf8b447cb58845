"""Sphinx extension that resolves references the way Python resolves names.

The API reference documents each object once, where it is defined. Docstrings and
notebooks name objects where they are importable from, and mention third-party names
without qualification; the two handlers below bridge both, and leave every other broken
reference to fail the build.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
from typing import Any

PACKAGE = "fsdp_guide"


def _lookup(dotted: str) -> Any:
    """The object that Python finds at ``dotted`` (a module, then attributes), else None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return None
        return value
    return None


def public_home(module: str) -> str:
    """The public module documenting what ``module`` defines: the part before any ``_`` name.

    Private modules (``fsdp_guide.memory._state``) are not in the API reference; their
    package's façade (``fsdp_guide.memory``) re-exports and documents what they define.

    Examples:
        >>> public_home("fsdp_guide.memory._state"), public_home("fsdp_guide.errors")
        ('fsdp_guide.memory', 'fsdp_guide.errors')
    """
    parts = module.split(".")
    first_private = next((i for i, p in enumerate(parts) if p.startswith("_")), len(parts))
    return ".".join(parts[:first_private])


def resolve_through_python(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve a reference to one of our names the way Python would (``missing-reference``).

    A docstring may name an object by where it is importable from (``:class:`LaunchTimeout```
    in a module that imports it, or ``fsdp_guide.launch`` for the function the package
    re-exports), while the API reference documents it once, where it is defined. This
    finds the object and links to that canonical entry.
    """
    if node.get("refdomain") != "py":
        return None
    target: str = node["reftarget"].lstrip("~.")
    module = node.get("py:module") or ""
    candidates = [target] if target.startswith(f"{PACKAGE}.") else []
    if module.startswith(PACKAGE):
        candidates.append(f"{module}.{target}")
    py = env.get_domain("py")
    for candidate in candidates:
        value = _lookup(candidate)
        origin = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None)
        if not isinstance(origin, str) or not isinstance(qualname, str):
            continue
        canonical = f"{public_home(origin)}.{qualname}"
        if canonical == candidate or not canonical.startswith(f"{PACKAGE}."):
            continue
        for role in (node["reftype"], "obj"):
            found = py.resolve_xref(
                env, node["refdoc"], app.builder, role, canonical, node, contnode
            )
            if found is not None:
                return found
    return None


def is_external_name(target: str, module: str | None) -> bool:
    """Whether an unqualified reference names something outside ``fsdp_guide``.

    True for a top-level module (``linecache``), a builtin (``Ellipsis``), or a name that
    the current module imported from another project (``Tensor`` in ``fsdp_guide.models``).
    A name found nowhere stays a broken reference: it is probably ours, misspelled.
    """
    if target.split(".")[0] == PACKAGE:
        return False
    if hasattr(builtins, target):
        return True
    try:
        if importlib.util.find_spec(target.split(".")[0]) is not None:
            return True
    except (ImportError, ValueError):
        pass
    if module and module.startswith(PACKAGE):
        origin = getattr(_lookup(f"{module}.{target}"), "__module__", None)
        return isinstance(origin, str) and not origin.startswith(PACKAGE)
    return False


def quiet_external_reference(app: Any, domain: Any, node: Any) -> bool | None:
    """Keep nitpicky quiet about unqualified third-party names (``warn-missing-reference``).

    Dotted third-party targets are covered by ``nitpick_ignore_regex`` in conf.py; this
    handles the unqualified ones, which a regex cannot tell apart from our own names.
    """
    if domain is None or domain.name != "py":
        return None
    if is_external_name(node["reftarget"].lstrip("~."), node.get("py:module")):
        return True
    return None


def setup(app: Any) -> dict[str, Any]:
    """Register both handlers with Sphinx."""
    app.connect("missing-reference", resolve_through_python)
    app.connect("warn-missing-reference", quiet_external_reference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
