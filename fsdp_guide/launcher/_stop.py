"""Stop launched ranks and everything they started; let go of their descriptors (private).

Stopping a rank sends ``SIGTERM`` to its process group and to every process below it (a
child subreaper keeps them all there, ``_tree.py``, even one that left for a session of its
own), then, after a grace, ``SIGKILL`` the same way. What a rank that died on its own left
behind is handed to the launcher, which ends it (``_tree.Adopter``). Exits are waited for
on pidfds: a process the rank started may hold the rank's other descriptors open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.connection import wait

from fsdp_guide.launcher._reports import Rank, exit_code
from fsdp_guide.launcher._tree import remove_rank, signal_tree

__all__: list[str] = []

TERMINATE_GRACE_S = 2.0
# A rank asked to stop gets this long to end on SIGTERM (its handler may save something).
_RANK_GRACE_S = 1.0


def wait_for_exits(ranks: list[Rank], timeout: float) -> None:
    """Wait until every rank of ``ranks`` has exited, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while left := [r for r in ranks if r.process.exitcode is None]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        # A sentinel (no pidfd: off Linux) may be held by what the rank started: poll too.
        ready = [r.exit_fd if r.exit_fd is not None else r.process.sentinel for r in left]
        wait(ready, min(remaining, 0.1))


def stop_all(ranks: list[Rank]) -> None:
    """Terminate every rank still running and what it started; SIGKILL after a short grace."""
    running = [r for r in ranks if exit_code(r) is None]
    for r in running:
        signal_tree(r.process.pid or 0, signal.SIGTERM)
    try:
        wait_for_exits(running, _RANK_GRACE_S)
    except KeyboardInterrupt:
        # A second interrupt (the stop button pressed twice) must not leave ranks running.
        _kill_all(ranks, running)
        raise
    _kill_all(ranks, running)


def _kill_all(ranks: list[Rank], running: list[Rank]) -> None:
    """SIGKILL every rank still running and what is below it, then wait for them."""
    for r in ranks:
        if r in running and r.process.exitcode is None:
            signal_tree(r.process.pid or 0, signal.SIGKILL)
        else:
            # What stayed in the group of a rank that exited (off Linux: all there is to find).
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.killpg(r.process.pid or 0, signal.SIGKILL)
    wait_for_exits(running, 5.0)


def close_all(ranks: list[Rank], wait_s: float = 0.0) -> None:
    """Close every pipe of the ranks, and the processes' own descriptors once they exited.

    Left to the garbage collector, a failed launch (whose traceback keeps these objects
    alive) would hold about eight descriptors per rank until the next collection. A rank
    still exiting is waited for up to ``wait_s``; past that its process object lets go of
    its descriptors when it is collected.
    """
    wait_for_exits(ranks, wait_s)
    for r in ranks:
        for conn in (r.result, r.probe, *(s.conn for s in r.streams)):
            conn.close()
        if r.exit_fd is not None:
            os.close(r.exit_fd)
            r.exit_fd = None
        if r.process.exitcode is not None:
            r.process.join()
            remove_rank(r.process.pid or 0)
        with contextlib.suppress(ValueError):  # still running: close() refuses
            r.process.close()
