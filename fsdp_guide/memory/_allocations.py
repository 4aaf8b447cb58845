"""Bytes a block of code allocates on one device, at its peak: :func:`track_allocations`.

A process's peak (``torch.cuda.max_memory_allocated``, or on CPU the resident set, libraries
and all) says little here. Building, loading and saving a sharded model are questions about
one stretch of code: how many bytes did it hold at once, beyond what was there before?

On CUDA that is the caching allocator's own counter (``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``). On CPU, torch's profiler records every allocation and
release of its CPU allocator with its size (``profile_memory=True``): tensors made by any
op, storages grown or freed by ``resize_`` (FSDP frees and refills its gathered parameters
that way), tensors read by ``torch.load``. Replaying those events in order gives the peak,
exactly. Only the block's own thread is followed (a collective backend's worker threads
are left out), and only what the block allocates: the profiler cannot size a block
allocated before it started, so releasing one is not counted. Torch then logs a warning
("Memory block of unknown size ...") from C++, which is expected here and left out of the
process's error output while the block runs (the rest of that output is passed on when
the block ends). Memory not taken through torch's allocator (a file mapped by
``torch.load(..., mmap=True)``, Python objects) is not counted either.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from fsdp_guide._own_allocations import own_allocations


@dataclass
class Allocations:
    """What a block allocated on one device, filled in when the block ends.

    Attributes:
        device: The device whose allocations were followed.
        peak: The most bytes held at once of what the block allocated.
        net: Bytes the block allocated and still held when it ended. (On CUDA both are
            read from the allocator's counters, so releasing older memory counts against
            them there.) On CPU a release made by another thread where the profiler does
            not follow it (gloo's workers dropping a collective's buffer) goes unseen, so
            ``net`` can include a buffer that was in fact freed.
        events: Allocations and releases seen (0 on CUDA, where the allocator counts).
    """

    device: torch.device
    peak: int = 0
    net: int = 0
    events: int = field(default=0, repr=False)


# The record_function that marks the thread whose allocations are followed.
_MARKER = "fsdp_guide:track_allocations"
# What torch's CPU allocator logs when the profiler sees a release it cannot size.
_UNSIZED_RELEASE = b"Memory block of unknown size was allocated before the profiling started"


@contextmanager
def _unsized_releases_unlogged() -> Iterator[None]:
    """Hold file descriptor 2 while the block runs; pass it on without the unsized-release line.

    The warning is written by C++ to the descriptor, where no Python filter reaches it.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().splitlines(keepends=True)
            kept = b"".join(line for line in lines if _UNSIZED_RELEASE not in line)
            if kept:
                os.write(2, kept)


def _replay(sizes: list[int]) -> tuple[int, int]:
    """Peak and final sum of a sequence of signed allocation sizes.

    Examples:
        >>> _replay([100, 50, -100, 30, -50])
        (150, 30)
    """
    held = peak = 0
    for size in sizes:
        held += size
        peak = max(peak, held)
    return peak, held


@contextmanager
def track_allocations(device: torch.device | str | None = None) -> Iterator[Allocations]:
    """Follow the bytes allocated on ``device`` while the block runs; the peak comes at exit.

    The calling thread's allocations are counted, and their release on any thread; other
    threads' are not (a collective backend's workers: gloo's staging copies, freed at
    moments that differ from run to run). Use it on one rank at a time (each rank tracks
    its own process) around building, loading or saving a model. Garbage
    left by earlier code is collected first, so that its release is not counted against
    the block.

    Args:
        device: ``"cpu"`` or a CUDA device; ``None`` is the CPU.

    Yields:
        Its ``Allocations``, filled in when the block ends.

    Raises:
        ValueError: For a device that is neither the CPU nor CUDA.

    Examples:
        >>> with track_allocations("cpu") as seen:
        ...     a = torch.zeros(1000)  # 4,000 bytes
        ...     b = torch.zeros(500)  # 2,000 bytes
        ...     del a
        >>> seen.peak, seen.net
        (6000, 2000)
    """
    dev = torch.device(device if device is not None else "cpu")
    seen = Allocations(dev)
    # Tensors of earlier code caught in reference cycles (a sharded model's hooks hold
    # one) are freed whenever the collector runs: let that be now, not inside the block.
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        yield seen
        torch.cuda.synchronize(dev)
        seen.peak = torch.cuda.max_memory_allocated(dev) - start
        seen.net = torch.cuda.memory_allocated(dev) - start
        return
    if dev.type != "cpu":
        raise ValueError(f"track_allocations follows the CPU or a CUDA device, not {dev}")
    from torch.profiler import ProfilerActivity, profile, record_function

    # Kineto prints a banner line per profile at its default log level: keep it quiet.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with (
        _unsized_releases_unlogged(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        record_function(_MARKER),
    ):
        yield seen
    own = own_allocations(prof, _MARKER, dev)
    seen.peak, seen.net = _replay([size for _, size in own.events])
    seen.events = len(own.events)
