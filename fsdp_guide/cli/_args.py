"""Reading command-line values into typed numbers, with one-line errors (private helpers).

Arguments are read as text and checked here rather than by argparse's ``type=``, so bad
input always gives one line on stderr and exit status 2.
"""

from __future__ import annotations

import math
import re

_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_int(option: str, text: str, minimum: int) -> int:
    """An integer option value, at least ``minimum``.

    Raises:
        ValueError: With a message naming the option and the fix.

    Examples:
        >>> parse_int("--steps", "3", 1)
        3
        >>> parse_int("--world-size", "0", 1)
        Traceback (most recent call last):
        ...
        ValueError: --world-size must be an integer >= 1, got '0'
    """
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{option} must be an integer >= {minimum}, got {text!r}")
    return value


def parse_count(option: str, text: str) -> float:
    """A positive count such as ``7e9``, ``7B``, ``1.3B`` or ``350M`` (powers of 1000).

    Raises:
        ValueError: For text that is not a positive count.

    Examples:
        >>> parse_count("--params", "7e9"), parse_count("--params", "1.5B")
        (7000000000.0, 1500000000.0)
        >>> parse_count("--params", "-3")
        Traceback (most recent call last):
        ...
        ValueError: --params must be a positive count such as 7e9, 7B or 350M, got '-3'
        >>> parse_count("--params", "1e400")
        Traceback (most recent call last):
        ...
        ValueError: --params must be a positive count such as 7e9, 7B or 350M, got '1e400'
    """
    match = _COUNT_RE.match(text)
    value = float(match.group(1)) * _COUNT_SCALE[match.group(2).lower()] if match else 0.0
    # Below 1 is no count of parameters; an overflow (1e400) reads as infinity.
    if not 1 <= value < math.inf:
        raise ValueError(f"{option} must be a positive count such as 7e9, 7B or 350M, got {text!r}")
    return value
