"""Make a rank's stack dump readable: the user's frames first, the machinery elided (private).

On timeout each rank prints every thread's stack with :mod:`faulthandler` (the only way to
get it while the rank is blocked inside a C++ collective). In a forked kernel that is about
40 lines, most recent call first, of which some 35 are ``multiprocessing``, the launcher,
IPython, ipykernel, tornado and asyncio; the line of the cell that hangs comes third, after
torch's. :class:`StackFilter` rewrites each thread's block as it passes through the relay.
"""

from __future__ import annotations

import os
import re
import sysconfig

__all__: list[str] = []

_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*\(most recent call first\):$")
_FRAME = re.compile(r'^  File "(?P<path>.+)", line \d+ in .+$')
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_ROOTS = tuple(
    sorted(
        {
            os.path.realpath(path)
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (path := sysconfig.get_paths().get(key))
        }
        | {_PACKAGE}
    )
)
# Where a rank's own work is entered: the worker, the magic's cell runner, multiprocessing.
_MACHINERY = (
    os.path.join(_PACKAGE, "launcher", "_worker.py"),
    os.path.join(_PACKAGE, "launcher", "magic.py"),
    os.sep + "multiprocessing" + os.sep,
)
# Threads the launcher itself starts in a rank (the parent-death watcher): not the user's
# work, so their whole block is left out of the report.
_OWN_THREADS = (os.path.join(_PACKAGE, "launcher", "_orphan.py"),)


def is_user_frame(path: str) -> bool:
    """Whether a frame's file is the user's: not the standard library, an installed package
    or fsdp_guide itself (a notebook cell's ``<distributed-cell-N>`` is the user's).

    Examples:
        >>> is_user_frame("<distributed-cell-3>"), is_user_frame(os.__file__)
        (True, False)
    """
    if path.startswith("<"):
        return not path.startswith("<frozen")
    return not os.path.realpath(path).startswith(_LIBRARY_ROOTS)


def rewrite_block(header: str, frames: list[str]) -> list[str]:
    """One thread's stack: the user's frames first, then the library code they are inside.

    The launcher's innermost frame marks where the rank's own work starts: it and every
    older frame (the launcher, the fork, in a notebook the kernel's event loop and the cell
    that ran ``%%distributed``) are dropped and counted.

    Examples:
        >>> worker = os.path.join(_PACKAGE, "launcher", "_worker.py")
        >>> frames = [
        ...     f'  File "{os.__file__}", line 9 in barrier',
        ...     '  File "<distributed-cell-1>", line 2 in <module>',
        ...     f'  File "{worker}", line 70 in run_rank',
        ...     '  File "/tmp/ipykernel_1/2.py", line 1 in <module>',
        ... ]
        >>> print("\\n".join(rewrite_block("Thread 0x1 (most recent call first):", frames)))
        Thread 0x1 (most recent call first):
          File "<distributed-cell-1>", line 2 in <module>
          inside library code, most recent call first:
            File ".../os.py", line 9 in barrier
          (2 lines of fork, launcher and kernel machinery elided)

        A thread the launcher started in the rank (its parent-death watcher) is left out:

        >>> orphan = os.path.join(_PACKAGE, "launcher", "_orphan.py")
        >>> rewrite_block("Thread 0x2 (most recent call first):", [
        ...     f'  File "{os.__file__}", line 82 in sigwait',
        ...     f'  File "{orphan}", line 88 in _wait_for_parent_death',
        ... ])
        []
    """
    paths = [m.group("path") if (m := _FRAME.match(f)) else "" for f in frames]
    if any(p in _OWN_THREADS for p in paths):
        return []
    launcher = [i for i, p in enumerate(paths) if any(m in p for m in _MACHINERY)]
    cut = launcher[0] if launcher else len(frames)
    user = [i for i in range(cut) if paths[i] and is_user_frame(paths[i])]
    inner = user[0] if user else 0
    lines = [header, *frames[inner:cut]]
    if inner > 0:
        lines.append("  inside library code, most recent call first:")
        lines.extend("  " + f for f in frames[:inner])
    elided = len(frames) - cut
    if elided:
        plural = "s" if elided > 1 else ""
        lines.append(f"  ({elided} line{plural} of fork, launcher and kernel machinery elided)")
    return lines


class StackFilter:
    """Rewrites faulthandler's per-thread blocks in a stream of lines; other lines pass.

    Examples:
        >>> orphan = os.path.join(_PACKAGE, "launcher", "_orphan.py")
        >>> kept = StackFilter().feed([
        ...     "Thread 0x2 (most recent call first):",
        ...     f'  File "{orphan}", line 88 in _wait_for_parent_death',
        ...     "",
        ...     "Current thread 0x1 (most recent call first):",
        ...     '  File "<distributed-cell-1>", line 2 in <module>',
        ...     "",
        ... ])
        >>> print("\\n".join(kept))
        Current thread 0x1 (most recent call first):
          File "<distributed-cell-1>", line 2 in <module>
        <BLANKLINE>
    """

    def __init__(self) -> None:
        self._header: str | None = None
        self._frames: list[str] = []
        self._dropped = False  # a block was left out: so is the blank line after it

    def feed(self, lines: list[str]) -> list[str]:
        """Lines ready to print, given the next lines of the stream."""
        out: list[str] = []
        for line in lines:
            if self._header is not None and (_FRAME.match(line) or line == "  ..."):
                self._frames.append(line)
                continue
            had_block = self._header is not None
            block = self.flush()
            out.extend(block)
            self._dropped = had_block and not block
            if _HEADER.match(line):
                self._header = line
            elif not (self._dropped and line == ""):
                out.append(line)
        return out

    def flush(self) -> list[str]:
        """The block in progress, rewritten (at end of stream, or before other output)."""
        if self._header is None:
            return []
        block = rewrite_block(self._header, self._frames)
        self._header, self._frames = None, []
        return block
