"""Refuse a spawn launch from a script's unguarded top level, before any rank starts (private).

A spawned rank is a fresh interpreter that first imports the script that launched it (as
``__mp_main__``), so that the script's functions exist there. A script that calls
:func:`~fsdp_guide.launcher.launch` at its top level, outside
``if __name__ == "__main__":``, would launch again during that import: multiprocessing
refuses, each rank dies with status 1, and the launcher could only say so. Read from the
calling frames and the script's source, the mistake is caught before any process starts.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
import tokenize
from types import FrameType, ModuleType

from fsdp_guide.errors import LaunchError

__all__: list[str] = []

_FIX = (
    'put the code that launches under `if __name__ == "__main__":` (the idiom the '
    "multiprocessing docs ask for), or call launch from a function that only that block calls"
)


def _rerun_by_spawn(main: ModuleType) -> bool:
    """Whether a spawned child imports ``main`` again (mirrors ``multiprocessing.spawn``)."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:  # run with ``python -m``: imported again by name
        return spec_name != "__main__" and not spec_name.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython"


def _outermost_main_frame(main: ModuleType) -> FrameType | None:
    """The frame running the main module's own top-level code, if it is on the stack."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            found = frame
        frame = frame.f_back  # type: ignore[assignment]
    return found


def _tests_name(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def is_guarded(source: str, line: int) -> bool:
    """Whether the top-level statement running at ``line`` sits under an ``if`` on ``__name__``.

    ``True`` too when it cannot tell (no statement there, or inside a function): only a
    certain mistake is refused.

    Examples:
        >>> is_guarded("import x\\nx.launch()\\n", 2)
        False
        >>> is_guarded("if __name__ == '__main__':\\n    main()\\n", 2)
        True
    """
    body: list[ast.stmt] = ast.parse(source).body
    while True:
        stmt = next((s for s in body if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
        if stmt is None:
            return True  # not found: no verdict, so no error
        if isinstance(stmt, ast.If) and _tests_name(stmt.test):
            return True
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            return True  # not top-level code
        inner: list[ast.stmt] = []
        for name in ("body", "orelse", "finalbody"):
            inner.extend(getattr(stmt, name, None) or [])
        for handler in getattr(stmt, "handlers", None) or []:
            inner.extend(handler.body)
        if not any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in inner):
            return False  # a simple statement of the top level, or of its loops and blocks
        body = inner


def check_main_guard() -> None:
    """Raise :class:`LaunchError` when spawned ranks would run this launch again.

    Inside a spawned rank that is importing the main module, this launch is that second
    run: refused with the same advice (the rank prints it before it dies).
    """
    where = "the script that launched this rank"
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        main = sys.modules.get("__main__")
        if main is None or not _rerun_by_spawn(main):
            return
        frame = _outermost_main_frame(main)
        if frame is None:
            return
        path, line = frame.f_code.co_filename, frame.f_lineno
        try:
            with tokenize.open(path) as f:
                if is_guarded(f.read(), line):
                    return
        except (OSError, SyntaxError, ValueError):
            return  # no source to read: let the ranks tell
        where = f"{path}, line {line}"
    raise LaunchError(
        f"launch with start_method='spawn' is called from the top level of {where}, "
        'outside `if __name__ == "__main__":`. Each spawned rank starts by importing that '
        "script, which would call launch again, and the rank would die before running "
        f"anything. Fix: {_FIX}."
    )
