"""Joining ``torch.distributed``: in launched ranks, under torchrun, in :func:`dist_init` (private).

Torch is imported inside the functions: a spawned rank imports this module (through
``_worker``) before its output is redirected, and torch's import is the slow part.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fsdp_guide.launcher._checks import check_world_size, resolve_backend
from fsdp_guide.launcher._entry import every_rank_enters
from fsdp_guide.launcher._fresh import fresh_prefix
from fsdp_guide.launcher._rendezvous import MASTER_ADDR

if TYPE_CHECKING:
    import torch

# Set in a rank that launch started: a launch inside it runs on the rank's group, and
# every rank must call it (checked at its entry, like the checkpoint helpers).
_launched_rank = False


def init_launched_rank(
    rank: int,
    world_size: int,
    backend: str,
    pg_timeout_s: float,
    listener: socket.socket | None,
) -> None:
    """Join the process group of a rank started by :func:`~fsdp_guide.launcher.launch`.

    The rendezvous is a ``TCPStore`` at ``MASTER_ADDR``/``MASTER_PORT`` (set by the
    worker); rank 0 serves it on ``listener`` when the launcher bound the port.
    """
    import torch
    import torch.distributed as dist

    global _launched_rank
    _launched_rank = True
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = timedelta(seconds=pg_timeout_s)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if listener is not None:
        # Rank 0 serves the store on the socket the launcher bound and kept open: no other
        # process can take the port between choosing it and listening on it.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            address,
            port,
            world_size,
            is_master=True,
            master_listen_fd=listener.fileno(),
            timeout=timeout,
        )
    else:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            address, port, world_size, is_master=rank == 0, timeout=timeout
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def run_under_torchrun(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    backend: str,
    timeout: float,
) -> list[Any]:
    """Run ``fn`` once on this torchrun rank and gather every rank's value (see ``launch``)."""
    import torch
    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    created = not dist.is_initialized()
    if not created and _launched_rank:
        every_rank_enters(
            "fsdp_guide.launch",
            why="inside a launched function, launch runs its function once on each rank, "
            "on the group the ranks already share",
        )
    if created:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        chosen = resolve_backend(backend, local_world)
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # torchrun's store outlives our groups (a second launch, and every restart of the
        # job, would read the previous group's stale gloo addresses and hang or fail,
        # pytorch/pytorch#55967 and #135712): each group gets keys no earlier one used.
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", timeout=timedelta(seconds=timeout)))
        prefix = fresh_prefix(store, rank, world_size, timeout)
        store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        dist.init_process_group(
            chosen,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    value = fn(rank, world_size, *args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    # Destroyed on success only: after a failure, destroying the group can block this rank
    # on peers still inside a collective, and it would never exit for torchrun to notice.
    if created:
        dist.destroy_process_group()
    return gathered


def dist_init(
    rank: int,
    world_size: int,
    backend: str = "gloo",
    master_addr: str = MASTER_ADDR,
    master_port: int | None = None,
    timeout: float = 300.0,
) -> None:
    """Initialise ``torch.distributed`` in a process you started yourself (``mp.spawn``).

    The FairScale docs call this helper without defining it. Every rank must agree on the
    address and port: the port comes from ``master_port``, else ``MASTER_PORT``, else 29500.
    With NCCL, the rank's GPU becomes the current device.

    Args:
        rank: This process's rank.
        world_size: Number of ranks.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"``.
        master_addr: Address of rank 0.
        master_port: Port of rank 0's rendezvous store.
        timeout: Seconds collectives wait before failing.

    Raises:
        ValueError: Bad ``world_size``, ``rank`` or backend.

    Examples:
        >>> import torch.distributed as dist
        >>> from fsdp_guide.launcher import find_free_port
        >>> dist_init(0, 1, master_port=find_free_port())
        >>> dist.get_world_size()
        1
        >>> dist.destroy_process_group()
    """
    world_size = check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    chosen = resolve_backend(backend, world_size)
    port = master_port if master_port is not None else int(os.environ.get("MASTER_PORT", 29500))
    import torch
    import torch.distributed as dist

    if chosen == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        chosen,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def rank_device() -> torch.device:
    """The device this rank computes on, decided by the process group's backend.

    Under NCCL, ``cuda:LOCAL_RANK`` (the GPU :func:`~fsdp_guide.launcher.launch` and
    ``torchrun`` made current; the current GPU
    when ``LOCAL_RANK`` is unset); under any other backend (gloo), the CPU, even on a
    machine with GPUs. Every engine of :func:`fsdp_guide.wrap.shard` places a rank's shards
    there, so a gloo run computes on the CPU whichever engine it uses.

    Returns:
        ``torch.device("cuda", local_rank)`` or ``torch.device("cpu")``.

    Raises:
        RuntimeError: When no process group is initialised.

    Examples:
        >>> import torch.distributed as dist
        >>> from fsdp_guide.launcher import find_free_port
        >>> dist_init(0, 1, backend="gloo", master_port=find_free_port())
        >>> rank_device()
        device(type='cpu')
        >>> dist.destroy_process_group()
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "rank_device() needs a torch.distributed process group: call it inside a "
            "function run by fsdp_guide.launch (or under torchrun, or after dist_init)"
        )
    # "nccl", or "cpu:gloo,cuda:nccl" for a group with a backend per device type.
    if "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
    return torch.device("cuda", index)
