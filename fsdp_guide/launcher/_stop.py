"""Stop launched ranks and everything they started; let go of their descriptors (private).

A rank below a guard (``_guard.py``; its own pid differs from its process's) is stopped
through the guard: ``SIGTERM`` to the guard, which passes it on once, waits a shorter grace
than ours and kills whatever is left. A rank without a guard (off Linux) leads a process
group, which gets the signals instead. Either way ``SIGKILL`` follows after a grace.
A rank whose guard already reported its exit code has nothing left below it: its guard is
only exiting, and is not waited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.process import BaseProcess

from fsdp_guide.launcher._reports import Rank, exit_code

__all__: list[str] = []

TERMINATE_GRACE_S = 2.0


def _kill_group(process: BaseProcess, sig: int) -> None:
    pid = process.pid
    if pid is None or process.exitcode is not None:
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        # The rank has not become a group leader yet (or already left): signal it alone.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _guarded(r: Rank) -> bool:
    return r.pid is not None and r.pid != r.process.pid


def stop_all(ranks: list[Rank]) -> None:
    """Terminate every rank still running and what it started; SIGKILL after a short grace."""
    running = [r for r in ranks if exit_code(r) is None]
    for r in running:
        if _guarded(r):
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.process.pid or 0, signal.SIGTERM)
        else:
            _kill_group(r.process, signal.SIGTERM)
    try:
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for r in running:
            r.process.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        # A second interrupt (the stop button pressed twice) must not leave ranks running.
        _kill_all(ranks, running)
        raise
    _kill_all(ranks, running)


def _kill_all(ranks: list[Rank], running: list[Rank]) -> None:
    """SIGKILL the process group of every rank, then wait for those that were running."""
    for r in ranks:
        if r in running and r.process.exitcode is None:
            _kill_group(r.process, signal.SIGKILL)
        elif not _guarded(r):
            # The leader is gone; make sure nothing it started survives (a guard saw to it).
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.killpg(r.process.pid or 0, signal.SIGKILL)
    for r in running:
        r.process.join(5.0)


def close_all(ranks: list[Rank], wait_s: float = 0.0) -> None:
    """Close every pipe of the ranks, and the processes' own descriptors once they exited.

    Left to the garbage collector, a failed launch (whose traceback keeps these objects
    alive) would hold about eight descriptors per rank until the next collection. A guard
    that is still exiting is waited for up to ``wait_s``; past that its process object
    lets go of its two descriptors when it is collected (or reaped by the next launch).
    """
    deadline = time.monotonic() + wait_s
    for r in ranks:
        for conn in (r.result, r.probe, *(s.conn for s in r.streams)):
            conn.close()
        r.process.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ValueError):  # still running: close() refuses
            r.process.close()
