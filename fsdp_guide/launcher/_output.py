"""Relay a rank's output to the caller, whole lines at a time, prefixed with the rank (private)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TextIO

from fsdp_guide.launcher._stacks import StackFilter

__all__: list[str] = []

# A line longer than this is printed in pieces, so a rank writing without newlines cannot
# make the caller buffer without bound.
_MAX_LINE_CHARS = 1 << 20


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@dataclass
class _Stream:
    rank: int
    conn: Connection
    sink: TextIO
    decoder: codecs.IncrementalDecoder = field(default_factory=_utf8_decoder)
    pending: list[str] = field(default_factory=list)  # pieces of the unfinished line
    pending_chars: int = 0
    stacks: StackFilter | None = None  # rewrites stack dumps (on the stderr stream)


def _emit(stream: _Stream, data: bytes, final: bool = False) -> None:
    """Print every complete line of ``data`` with the rank prefix; keep the rest pending.

    Only the new data is searched for newlines, so a long line costs linear time; a line
    longer than ``_MAX_LINE_CHARS`` is printed in pieces of that length.
    """
    text = stream.decoder.decode(data, final)
    lines: list[str] = []
    if "\n" in text:
        first, *middle, rest = text.split("\n")
        lines.append("".join(stream.pending) + first)
        lines.extend(middle)
        stream.pending, stream.pending_chars = ([rest] if rest else []), len(rest)
    elif text:
        stream.pending.append(text)
        stream.pending_chars += len(text)
    if stream.pending_chars >= _MAX_LINE_CHARS or (final and stream.pending):
        rest = "".join(stream.pending)
        while len(rest) >= _MAX_LINE_CHARS or (final and rest):
            lines.append(rest[:_MAX_LINE_CHARS])
            rest = rest[_MAX_LINE_CHARS:]
        stream.pending, stream.pending_chars = ([rest] if rest else []), len(rest)
    if stream.stacks is not None:
        lines = stream.stacks.feed(lines)
        if final:
            lines.extend(stream.stacks.flush())
    if lines:
        prefix = f"[rank{stream.rank}] "
        stream.sink.write("".join(f"{prefix}{line}\n" for line in lines))
        stream.sink.flush()
