"""What a step prints, read back: pytest's summary line, data tables, skips, the tail.

The script's own steps print what pytest would (``CHECK`` lines and a summary line), plus
tables for the report on lines that start with :data:`DATA_PREFIX`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

DATA_PREFIX = "GPU_VALIDATION_DATA "
TAIL_LINES = 40
TAIL_CHARS = 4000

# Tables printed by a step: title to rows.
Tables = dict[str, list[dict[str, Any]]]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_COUNT = re.compile(r"^(\d+) ([a-z]+)$")
_SUMMARY = re.compile(r"^(?P<body>.+?) in (?P<seconds>[0-9]+(?:\.[0-9]+)?)s(?: \([0-9:]+\))?$")
_COUNT_NAMES = {
    "passed": "passed",
    "failed": "failed",
    "skipped": "skipped",
    "error": "errors",
    "errors": "errors",
    "xfailed": "xfailed",
    "xpassed": "xpassed",
    "deselected": "deselected",
    "warning": "warnings",
    "warnings": "warnings",
}


@dataclass(frozen=True)
class Counts:
    """The counts of a pytest summary line (``3 passed, 1 skipped in 2.5s``).

    Attributes:
        passed: Tests (or checks) that passed.
        failed: That failed.
        skipped: That were skipped.
        errors: Errors (collection, fixtures).
        xfailed: Expected failures.
        xpassed: Unexpected passes.
        deselected: Deselected by ``-m``.
        warnings: Warnings reported.
        seconds: The time the line gives.
    """

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    xfailed: int = 0
    xpassed: int = 0
    deselected: int = 0
    warnings: int = 0
    seconds: float | None = None


def parse_summary(output: str) -> Counts | None:
    """The counts of the last pytest-style summary line in ``output``.

    Args:
        output: What pytest (or one of the script's steps) printed.

    Returns:
        The counts, or ``None`` when no line is a summary.

    Examples:
        >>> parse_summary("....\\n===== 3 passed, 1 skipped in 2.50s =====\\n")
        Counts(passed=3, failed=0, skipped=1, errors=0, xfailed=0, xpassed=0, deselected=0, warnings=0, seconds=2.5)
    """  # noqa: E501
    for raw in reversed(_ANSI.sub("", output).splitlines()):
        match = _SUMMARY.match(raw.strip().strip("=!").strip())
        if match is None:
            continue
        body = match.group("body")
        values: dict[str, int] = {}
        if body != "no tests ran":
            for part in body.split(", "):
                count = _COUNT.match(part.strip())
                if count is None or count.group(2) not in _COUNT_NAMES:
                    values = {}
                    break
                key = _COUNT_NAMES[count.group(2)]
                values[key] = values.get(key, 0) + int(count.group(1))
            if not values:
                continue
        return Counts(**values, seconds=float(match.group("seconds")))
    return None


def summary_line(passed: int, failed: int, skipped: int, seconds: float) -> str:
    """A summary line in pytest's words, which :func:`parse_summary` reads back.

    Examples:
        >>> summary_line(2, 1, 0, 3.14159)
        '1 failed, 2 passed in 3.14s'
    """
    parts = [f"{failed} failed"] if failed else []
    parts += [f"{passed} passed"] if passed or not (failed or skipped) else []
    parts += [f"{skipped} skipped"] if skipped else []
    return f"{', '.join(parts)} in {seconds:.2f}s"


def step_status(returncode: int | None, timed_out: bool, counts: Counts | None) -> str:
    """``passed``, ``failed`` or ``timed out`` from how a step ended.

    A step passes when it exited 0 and its summary (if any) shows no failure or error;
    pytest's exit code 5 (no test collected) is a failure here.

    Examples:
        >>> step_status(0, False, Counts(passed=3))
        'passed'
        >>> step_status(0, False, Counts(passed=3, errors=1))
        'failed'
        >>> step_status(None, True, None)
        'timed out'
    """
    if timed_out:
        return "timed out"
    if returncode != 0 or (counts is not None and (counts.failed or counts.errors)):
        return "failed"
    return "passed"


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Print rows of a table for the report, on one line that :func:`parse_data` reads."""
    print(DATA_PREFIX + json.dumps({title: rows}, default=str), flush=True)


def parse_data(output: str) -> Tables:
    """Tables printed by the script's own steps, merged by title.

    Examples:
        >>> parse_data('x\\nGPU_VALIDATION_DATA {"t": [{"a": 1}]}\\nGPU_VALIDATION_DATA {"t": [{"a": 2}]}')
        {'t': [{'a': 1}, {'a': 2}]}
    """  # noqa: E501
    tables: Tables = {}
    for line in output.splitlines():
        if line.startswith(DATA_PREFIX):
            try:
                value = json.loads(line[len(DATA_PREFIX) :])
            except json.JSONDecodeError:
                continue
            for title, rows in value.items():
                tables.setdefault(title, []).extend(rows)
    return tables


def skips(name: str, output: str) -> Tables:
    """What step ``name`` skipped, from pytest's ``-rs`` lines and the steps' ``CHECK SKIP``.

    Examples:
        >>> skips("pytest", "SKIPPED [2] tests/t.py:9: needs 2 GPUs\\nCHECK SKIP x/y: why")
        {'Skipped': [{'step': 'pytest', 'what': '[2] tests/t.py:9: needs 2 GPUs'}, {'step': 'pytest', 'what': 'x/y: why'}]}
    """  # noqa: E501
    rows = []
    for line in _ANSI.sub("", output).splitlines():
        for prefix in ("SKIPPED ", "CHECK SKIP "):
            if line.startswith(prefix):
                rows.append({"step": name, "what": line[len(prefix) :].strip()})
    return {"Skipped": rows} if rows else {}


def output_tail(text: str, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    """The end of a command's output, safe to show in a markdown code block.

    ANSI colour codes are removed, a line that starts with ``|`` gets a ``¦`` instead (the
    docs read such lines as table rows), and at most ``lines`` lines and ``chars``
    characters are kept.

    Examples:
        >>> output_tail("a\\n\\x1b[31mb\\x1b[0m\\n  | Name | Type\\nc", lines=3)
        'b\\n  ¦ Name | Type\\nc'
    """
    cleaned = []
    for line in _ANSI.sub("", text).rstrip().splitlines()[-lines:]:
        stripped = line.lstrip()
        if stripped.startswith("|"):
            line = line[: len(line) - len(stripped)] + "¦" + stripped[1:]
        cleaned.append(line.rstrip())
    return "\n".join(cleaned)[-chars:]
