"""Tiny training-shaped functions for the ``demo`` command and the tests (private).

They live in a module (not a notebook) so they can be started with ``spawn``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_sum(rank: int, world_size: int) -> tuple[int, float]:
    """All-reduce ``1 / world_size`` from every rank; each rank returns its rank and the sum.

    Examples:
        >>> from fsdp_guide import launch
        >>> launch(rank_and_sum, world_size=2, start_method="spawn")
        [(0, 1.0), (1, 1.0)]
    """
    t = torch.tensor([1.0 / world_size])
    dist.all_reduce(t)
    return rank, round(float(t.item()), 6)


def hello(rank: int, world_size: int) -> dict[str, object]:
    """Print who this rank is, all-reduce its rank number, and return what it saw.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.

    Returns:
        The rank, the backend, the process id and the sum of all ranks.

    Examples:
        Each rank's lines reach the caller prefixed with its rank:

        >>> import contextlib, io
        >>> from fsdp_guide import launch
        >>> with contextlib.redirect_stdout(io.StringIO()) as printed:
        ...     results = launch(hello, world_size=2, backend="gloo", start_method="fork")
        >>> [r["rank_sum"] for r in results]
        [1.0, 1.0]
        >>> sorted(line.split(" (pid")[0] for line in printed.getvalue().splitlines()
        ...        if "hello" in line)
        ['[rank0] hello from rank 0 of 2', '[rank1] hello from rank 1 of 2']
    """
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    backend = dist.get_backend()
    print(f"hello from rank {rank} of {world_size} (pid {os.getpid()}, backend {backend})")
    print(f"all_reduce of the ranks gives {t.item():g}")
    return {"rank": rank, "backend": backend, "pid": os.getpid(), "rank_sum": t.item()}
