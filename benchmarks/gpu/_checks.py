"""The checks of an in-process step, printed the way the runner reads pytest's output."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ._output import print_table, summary_line


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest ``|a - b| / |b|``; infinite when the lengths differ or ``a`` is empty.

    Examples:
        >>> max_rel_diff([1.0, 3.0], [1.0, 2.0]), max_rel_diff([], [])
        (0.5, inf)
    """
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def finite(values: Sequence[float]) -> bool:
    """Whether there are values and none is NaN or infinite."""
    return bool(values) and all(v == v and abs(v) != float("inf") for v in values)


class Checks:
    """Checks of one in-process step: ``CHECK`` lines, tables, and a pytest-style summary."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.passed = self.failed = self.skipped = 0
        self.start = time.monotonic()

    def record(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record one check; returns ``ok``."""
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"CHECK {'PASS' if ok else 'FAIL'} {self.step}/{name}: {detail}", flush=True)
        return ok

    def close(self, name: str, got: Sequence[float], want: Sequence[float], rtol: float) -> float:
        """Check that ``got`` is ``want`` within ``rtol``; returns the largest difference."""
        diff = max_rel_diff(got, want)
        self.record(name, diff <= rtol, f"largest relative difference {diff:.2e}")
        return diff

    def skip(self, name: str, reason: str) -> None:
        """Record a check not made."""
        self.skipped += 1
        print(f"CHECK SKIP {self.step}/{name}: {reason}", flush=True)

    def guard(self, name: str, body: Callable[[], None]) -> None:
        """Run ``body``; an exception in it is a failed check (its traceback printed)."""
        try:
            body()
        except Exception as exc:
            traceback.print_exc()
            self.record(name, False, f"raised {type(exc).__name__}: {exc}"[:500])

    def table(self, title: str, row: dict[str, Any]) -> None:
        """Print one row of a table for the report."""
        print_table(title, [row])

    def finish(self) -> int:
        """Print the summary line; exit status 1 when a check failed."""
        seconds = time.monotonic() - self.start
        print(summary_line(self.passed, self.failed, self.skipped, seconds), flush=True)
        return 1 if self.failed else 0
