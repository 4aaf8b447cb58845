"""Refuse a collective helper called on some ranks only, within seconds (private).

The DDP tutorials teach ``if rank == 0: torch.save(...)``; written with a collective helper
such as :func:`fsdp_guide.checkpoint.save`, the same habit leaves rank 0 alone in a
collective that the other ranks never enter, and it hangs for the whole process-group
timeout (300 s by default) with nothing to say why. :func:`every_rank_enters` is a short
agreement at the helper's entry, on the rendezvous store rather than the process group, so
that its own timeout can be short: each rank sets a key for this call and waits for every
rank's key.
"""

from __future__ import annotations

import os
import time

from fsdp_guide.errors import CollectiveCallError

__all__: list[str] = []

ENTRY_TIMEOUT_ENV = "FSDP_GUIDE_ENTRY_TIMEOUT"
_DEFAULT_ENTRY_TIMEOUT_S = 5.0
_POLL_S = 0.02

# How many times this process entered each helper: every rank calls the helpers in the same
# order, so the count names the same call on every rank.
_entered: dict[str, int] = {}


def entry_timeout() -> float:
    """Seconds a rank waits at a helper's entry for the others: ``FSDP_GUIDE_ENTRY_TIMEOUT``, or 5.

    Raises:
        ValueError: ``FSDP_GUIDE_ENTRY_TIMEOUT`` is not a positive number.

    Examples:
        >>> entry_timeout()
        5.0
    """
    value = os.environ.get(ENTRY_TIMEOUT_ENV)
    if not value:
        return _DEFAULT_ENTRY_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{ENTRY_TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return seconds


def every_rank_enters(call: str, why: str = "it already writes each file once") -> None:
    """Wait briefly until every rank of the default process group has entered ``call``.

    Without a process group, or on one rank, there is nothing to wait for.

    Args:
        call: The helper's public name, e.g. ``"fsdp_guide.checkpoint.save"``.
        why: Why calling it on every rank is right, for the error message.

    Raises:
        RuntimeError: ``CollectiveCallError``: Some rank did not enter ``call`` within
            :func:`entry_timeout` seconds (or had already finished); the message names the
            ranks and the usual mistake.

    Examples:
        >>> every_rank_enters("fsdp_guide.checkpoint.save")  # no process group: no-op
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    timeout = entry_timeout()
    rank, world = dist.get_rank(), dist.get_world_size()
    count = _entered.get(call, 0)
    _entered[call] = count + 1
    prefix = f"fsdp_guide/entry/{call}/{count}"
    store = _get_default_store()
    keys = [f"{prefix}/{r}" for r in range(world)]

    def refuse(missing: str) -> CollectiveCallError:
        return CollectiveCallError(
            f"{call} is collective: every rank must call it, but {missing}. The usual "
            f"mistake is `if rank == 0:` around the call: call {call.rsplit('.', 1)[-1]}() "
            f"on every rank ({why}). If the other ranks are only slow to get there, set "
            f"{ENTRY_TIMEOUT_ENV} to more seconds."
        )

    try:
        store.set(f"{prefix}/{rank}", "1")
        # Polled rather than store.wait(): its timeout prints two C++ warnings per rank.
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if time.monotonic() >= deadline:
                missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
                raise refuse(f"ranks {missing} did not within {timeout:g} s of rank {rank}")
            time.sleep(_POLL_S)
    except RuntimeError as exc:  # the store is gone: the rank serving it has finished
        if isinstance(exc, CollectiveCallError):
            raise
        raise refuse(f"the rank serving the rendezvous had finished when rank {rank} did") from None
