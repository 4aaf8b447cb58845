"""A store namespace that every rank of this start agrees on and no earlier start used (private).

Under torchrun's c10d rendezvous the workers' store is served by an agent (torch's default
since 2.4) and outlives the workers: after a restart, it still holds every key the previous
start wrote. A process group built again under the same prefix reads those keys: gloo finds
the previous ranks' addresses there, connects to processes that no longer exist, and fails
("Connection refused") or hangs, whenever a restarted rank reaches the store before the peer
whose key it reads. ``TORCHELASTIC_RESTART_COUNT`` cannot name the start: each agent counts
its own restarts, and an agent that only stopped its workers because another node failed
does not count that one (pytorch/pytorch#135712).

:func:`fresh_prefix` agrees on a new random token instead. Rank 0 publishes its token; every
other rank registers under the token it reads, with a random nonce of its own, and waits
for rank 0's answer to that nonce, a key no earlier start can have written. A rank that
read a previous start's token gets no answer (that rank 0 is gone) and reads the token
again, until rank 0 of this start has published its own.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

_ROOT = "fsdp_guide/start"
_POLL_S = 0.01
_REREAD_S = 0.25  # how long a rank waits for an answer before reading the token again


def fresh_prefix(store: Store, rank: int, world_size: int, timeout: float) -> str:
    """A key prefix for this start's process group, the same on every rank.

    Args:
        store: The store every rank of the job reaches (torchrun's).
        rank: This rank.
        world_size: Ranks that take part; all must call this.
        timeout: Seconds to wait for the other ranks.

    Returns:
        ``"fsdp_guide/<token>"``, a token no earlier start used.

    Raises:
        TimeoutError: The other ranks (or rank 0) did not take part within ``timeout``.

    Examples:
        >>> import torch.distributed as dist
        >>> store = dist.HashStore()
        >>> first, second = fresh_prefix(store, 0, 1, 5.0), fresh_prefix(store, 0, 1, 5.0)
        >>> first.startswith("fsdp_guide/") and first != second
        True
    """
    deadline = time.monotonic() + timeout
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(_ROOT, token)
        waiting = set(range(1, world_size))
        while waiting:
            for other in sorted(waiting):
                key = f"{_ROOT}/{token}/join/{other}"
                if store.check([key]):
                    nonce = store.get(key).decode()
                    store.set(f"{_ROOT}/{token}/welcome/{nonce}", "1")
                    waiting.discard(other)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(waiting)} did not join rank 0's process group within "
                    f"{timeout:g} s"
                )
            time.sleep(_POLL_S if waiting else 0)
        return f"fsdp_guide/{token}"
    nonce = uuid.uuid4().hex
    while time.monotonic() < deadline:
        if not store.check([_ROOT]):  # rank 0 has not published yet
            time.sleep(_POLL_S)
            continue
        token = store.get(_ROOT).decode()
        store.set(f"{_ROOT}/{token}/join/{rank}", nonce)
        answer = f"{_ROOT}/{token}/welcome/{nonce}"
        reread = min(deadline, time.monotonic() + _REREAD_S)
        while time.monotonic() < reread:
            if store.check([answer]):
                return f"fsdp_guide/{token}"
            time.sleep(_POLL_S)
    raise TimeoutError(f"rank {rank} got no answer from rank 0 within {timeout:g} s")
