"""What torch's profiler says about itself, kept out of a rank's output (private).

A lesson's stored output should hold what the step measured, not the profiler's notices:
the lines native code writes to file descriptor 2 when the profiler starts and stops, the CPU
allocator's notice that a block allocated before profiling was freed, and the memory
profile's log of allocations and frees it could not pair.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def native_stderr_closed() -> Iterator[None]:
    """Send what native code writes to stderr to /dev/null: the profiler logs a line when it
    starts and stops on every rank, which would bury a lesson's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


#: Lines torch writes to file descriptor 2 during a recorded step that say nothing about
#: it: the CPU allocator's notice that a block allocated before the profiler started (the
#: model state, which ``state_before`` gives) was freed.
_NOTICES = (b"allocated before the profiling started",)


@contextmanager
def native_stderr_filtered(drop: tuple[bytes, ...] = _NOTICES) -> Iterator[None]:
    """Pass what is written to file descriptor 2 on, line by line, without the lines that
    hold one of ``drop``: torch's allocator logs them from native code, where Python's
    warning filters do not reach, and a lesson's output would keep them, timestamped."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def relay() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not any(notice in line for notice in drop):
                    os.write(saved, line)

    thread = threading.Thread(target=relay, name="fsdp_guide-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the relay reads to the end
        thread.join()
        os.close(saved)


@contextmanager
def quiet() -> Iterator[None]:
    """The memory profile's own notices off: the deprecation of the timeline export, and
    its log of allocations and frees it could not pair (a block freed by another thread)."""
    logger = logging.getLogger("torch.profiler._memory_profiler")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)
