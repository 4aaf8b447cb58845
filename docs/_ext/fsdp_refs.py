"""Sphinx extension that resolves references the way Python resolves names.

The API reference documents each object under the façade that exports it. Type hints name
objects where they are defined (a private module), docstrings where they are importable
from, and both mention third-party names without qualification; the two handlers below
bridge all three (intersphinx links third-party names when its inventories are reachable),
and leave every other broken reference to fail the build.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import re
from typing import Any

from fsdp_links import public_home

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


def _documented_as(py: Any, value: Any, qualname: str, home: str) -> list[str]:
    """Names under which the API reference documents ``value``, the one at ``home`` first.

    A façade documents each name of its ``__all__`` under its own path, and the package
    re-exports some of them, so one object may have several entries; any of them will do.
    """
    names = [
        name for name in py.objects if name.endswith(f".{qualname}") and _lookup(name) is value
    ]
    return sorted(names, key=lambda name: (not name.startswith(f"{home}."), len(name)))


def resolve_through_python(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve a reference to one of our names the way Python would (``missing-reference``).

    Type hints name an object where it is defined (``fsdp_guide.memory._plan.Plan``) and a
    docstring may name it where it is imported (``:class:`LaunchTimeout``` in a module that
    imports it), while the API reference documents it under a façade
    (``fsdp_guide.memory.Plan``). This finds the object and links to its entry there.
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
        for name in _documented_as(py, value, qualname, public_home(origin)):
            if name == candidate:
                continue
            for role in (node["reftype"], "obj"):
                found = py.resolve_xref(
                    env, node["refdoc"], app.builder, role, name, node, contnode
                )
                if found is not None:
                    return found
    return None


def is_external_name(target: str, module: str | None, cls: str | None = None) -> bool:
    """Whether an unqualified reference names something outside ``fsdp_guide``, or private.

    True for a top-level module (``linecache``), a builtin (``Ellipsis``), or a name that
    the current module imported from another project (``Tensor`` in ``fsdp_guide.models``).
    A class documented on its façade's page (``cls`` there) has its signature's names looked
    up where it is defined too: ``Precision`` in ``DDPShardedStrategy``'s is Lightning's, and
    a name only a private module defines (``StartMethod``) is private, so plain text.
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
        if isinstance(origin, str) and not origin.startswith(PACKAGE):
            return True
        defined_in = getattr(_lookup(f"{module}.{cls}"), "__module__", None) if cls else None
        if isinstance(defined_in, str) and defined_in != module:
            found = _lookup(f"{defined_in}.{target}")
            origin = getattr(found, "__module__", None) or defined_in
            private = any(part.startswith("_") for part in str(origin).split(".")[1:])
            return found is not None and (not str(origin).startswith(PACKAGE) or private)
    return False


def quiet_external_reference(app: Any, domain: Any, node: Any) -> bool | None:
    """Keep nitpicky quiet about unqualified third-party names (``warn-missing-reference``).

    Dotted third-party targets are covered by ``nitpick_ignore_regex`` in conf.py; this
    handles the unqualified ones, which a regex cannot tell apart from our own names.
    """
    if domain is None or domain.name != "py":
        return None
    if is_external_name(
        node["reftarget"].lstrip("~."), node.get("py:module"), node.get("py:class")
    ):
        return True
    return None


_PRIVATE = re.compile(r"^fsdp_guide(\.\w+)*\._\w")
_TILDE_PATH = re.compile(r"~(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")


def drop_tilde_paths(app: Any, doctree: Any) -> None:
    """Show types by their short names (``doctree-read``), as a reader imports them.

    ``type[~torch.nn.modules.module.Module]`` becomes ``type[Module]``.

    autodoc's short type format leaves the ``~`` and the defining module inside some nested
    annotations of a parameter's type; the reader should see the short name, as elsewhere.
    """
    from docutils import nodes
    from sphinx import addnodes

    for text in list(doctree.findall(nodes.Text)):
        if "~" in text and _TILDE_PATH.search(text):
            text.parent.replace(text, nodes.Text(_TILDE_PATH.sub(r"\1", str(text))))
    # A type named by its defining module (``fsdp_guide.memory._state.ModelState``, as napoleon
    # writes an attribute's annotation) shows its short name; the link goes to its façade.
    for xref in doctree.findall(addnodes.pending_xref):
        target = xref.get("reftarget", "")
        if _PRIVATE.search(target) and xref.astext() == target:
            for text in list(xref.findall(nodes.Text)):
                text.parent.replace(text, nodes.Text(target.rsplit(".", 1)[-1]))


def setup(app: Any) -> dict[str, Any]:
    """Register the handlers with Sphinx."""
    app.connect("missing-reference", resolve_through_python)
    app.connect("warn-missing-reference", quiet_external_reference)
    app.connect("doctree-read", drop_tilde_paths)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
