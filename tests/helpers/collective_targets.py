"""Launched functions that misuse collectives, or are merely slow, for the hang-watch tests."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def swapped_order(rank: int, world_size: int) -> int:
    """Rank 0 all-reduces then broadcasts; the others broadcast then all-reduce."""
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
    else:
        dist.broadcast(t, src=0)
        dist.all_reduce(t)
    return rank


def barrier_on_rank_zero_only(rank: int, world_size: int) -> int:
    """Rank 0 waits in a barrier that the others skip on their way to an all-reduce."""
    if rank == 0:
        dist.barrier()
    dist.all_reduce(torch.ones(1))
    return rank


def object_against_tensor(rank: int, world_size: int) -> int:
    """Rank 0 broadcasts a Python object while the others all-reduce a tensor."""
    if rank == 0:
        dist.broadcast_object_list([{"step": 1}], src=0)
    else:
        dist.all_reduce(torch.ones(8))
    return rank


def _busy(seconds: float) -> None:
    a = torch.randn(64, 64)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def slow_peer(rank: int, world_size: int, how: str, seconds: float) -> int:
    """Rank 0 waits in a barrier while rank 1 sleeps or computes, then joins it: no mistake."""
    if rank == 1:
        if how == "sleep":
            time.sleep(seconds)
        else:
            _busy(seconds)
    dist.barrier()
    dist.all_reduce(torch.ones(1))
    return rank


def times_ten(rank: int, world_size: int) -> int:
    return rank * 10


def launch_on_rank_zero_only(rank: int, world_size: int, busy_s: float) -> object:
    """The DDP tutorials' `if rank == 0:` habit applied to a nested launch."""
    from fsdp_guide import launch

    if rank == 0:
        return launch(times_ten)
    time.sleep(busy_s)
    return rank
