"""Sphinx extension: a Python warning raised while the site builds is a Sphinx warning.

``-W`` turns Sphinx's own warnings into errors, but a ``DeprecationWarning`` from an
extension only reaches stderr, and the build succeeds with it (92 of them once did). This
routes every Python warning shown during the build through Sphinx's logger, so the strict
build fails on it and names where it came from.
"""

from __future__ import annotations

import warnings
from typing import Any

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _show_through_sphinx(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    logger.warning(
        f"{category.__name__}: {message} ({filename}:{lineno})",
        type="python",
        subtype=category.__name__,
    )


def setup(app: Any) -> dict[str, Any]:
    """Route Python warnings to Sphinx's logger for the rest of the build."""
    warnings.showwarning = _show_through_sphinx
    return {"parallel_read_safe": True, "parallel_write_safe": True}
