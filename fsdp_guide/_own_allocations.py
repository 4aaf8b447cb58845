"""The allocations one thread made under torch's profiler (private: memory and timeline use it).

A collective backend runs its work on threads of its own. Gloo's workers allocate staging
copies of the tensors they gather and reduce, and free them at moments that differ from run
to run; NCCL keeps its buffers outside torch's allocator altogether. What a rank's training
holds is what its own thread allocates, so that is what is followed here: each allocation the
marked thread made, and its release on whichever thread it happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OwnAllocations:
    """The marked thread's allocations on one device, in time order.

    Attributes:
        events: ``(time in ns, signed bytes)``: an allocation is positive, its release
            negative.
        foreign: Allocation ids (where the profiler recorded them) of blocks other threads
            allocated: what a memory profile of the same run must leave out too.
    """

    events: tuple[tuple[int, int], ...]
    foreign: frozenset[int]

    @property
    def unreleased(self) -> int:
        """Bytes allocated and not released by the end of the profile."""
        return sum(size for _, size in self.events)


def _walk(events: Iterable[Any]) -> Iterator[Any]:
    for event in events:
        yield event
        yield from _walk(event.children)


def own_allocations(
    profiler: torch.profiler.profile, marker: str, device: torch.device
) -> OwnAllocations:
    """The allocations of the thread that ran the ``record_function`` named ``marker``.

    Args:
        profiler: A stopped profiler that ran with ``profile_memory=True``.
        marker: The name of a ``record_function`` the thread to follow entered.
        device: The device whose allocations are followed.

    Returns:
        The thread's :class:`OwnAllocations`.

    Raises:
        ValueError: If no event is named ``marker``.
    """
    tree = list(_walk(profiler.profiler.kineto_results.experimental_event_tree()))  # type: ignore[union-attr]
    thread = next((e.start_tid for e in tree if e.name == marker), None)
    if thread is None:
        raise ValueError(f"the profile has no record_function named {marker!r}")
    allocation = torch._C._profiler._EventType.Allocation
    blocks = sorted(
        (e for e in tree if e.typed[0] == allocation and e.typed[1].device == device),
        key=lambda e: e.start_time_ns,
    )
    live: dict[int, int] = {}  # address -> bytes of the thread's blocks not yet released
    events: list[tuple[int, int]] = []
    foreign: set[int] = set()
    for block in blocks:
        fields = block.typed[1]
        if fields.alloc_size > 0 and block.start_tid == thread:
            live[fields.ptr] = fields.alloc_size
            events.append((block.start_time_ns, fields.alloc_size))
        elif fields.alloc_size > 0:
            if fields.allocation_id is not None:
                foreign.add(fields.allocation_id)
        elif fields.ptr in live:
            events.append((block.start_time_ns, -live.pop(fields.ptr)))
    return OwnAllocations(tuple(events), frozenset(foreign))
