"""How ranks agree on a failure, so that none is left waiting in a collective (private).

Every rank catches its own error (:func:`attempt`), the errors are exchanged
(:func:`agree`, the one mechanism for this, which can carry a value from every rank too),
and all ranks raise the same :class:`~fsdp_guide.errors.CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_guide.checkpoint._dcp import describe_failure
from fsdp_guide.errors import CheckpointError

_T = TypeVar("_T")


class Failure(NamedTuple):
    """An error on some rank: the rank it happened on, and what went wrong."""

    rank: int
    message: str


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one.

    Examples:
        >>> rank_and_world()
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def attempt(action: Callable[[], _T]) -> tuple[_T | None, Failure | None]:
    """Run ``action``; return ``(value, None)``, or ``(None, failure)`` if it raised.

    DCP raises the same ``CheckpointException`` on every rank; its failure is attributed to
    the rank where it happened, so all ranks report it alike.

    Examples:
        >>> attempt(lambda: 1 / 0)
        (None, Failure(rank=0, message='ZeroDivisionError: division by zero'))
    """
    try:
        return action(), None
    except CheckpointException as exc:  # a BaseException, so caught by name
        return None, Failure(*describe_failure(exc))
    except CheckpointError as exc:
        return None, Failure(rank_and_world()[0], str(exc))
    except Exception as exc:
        return None, Failure(rank_and_world()[0], f"{type(exc).__name__}: {exc}")


def agree(failure: Failure | None, value: Any = None) -> list[Any]:
    """Exchange every rank's ``value`` and ``failure`` (collective); all raise the first failure.

    Returns:
        Every rank's ``value``, ordered by rank, when no rank failed.

    Raises:
        CheckpointError: Some rank failed; the lowest failing rank's message, prefixed with
            that rank when several run, unless every rank failed alike.

    Examples:
        >>> agree(None, {"written": 2})
        [{'written': 2}]
        >>> agree(Failure(0, "disk full"))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: disk full
    """
    _, world = rank_and_world()
    gathered: list[Any] = [(value, failure)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (value, failure))
    failures = [Failure(*f) for _, f in gathered if f is not None]
    if failures:
        first = min(failures)
        # Each rank failing alike on its own (a check of the same inputs) is not one rank's
        # failure: naming a rank would only mislead.
        everywhere = {f.rank for f in failures} == set(range(world)) and all(
            f.message == first.message for f in failures
        )
        prefix = "" if world == 1 or everywhere else f"rank {first.rank}: "
        raise CheckpointError(prefix + first.message)
    return [v for v, _ in gathered]
