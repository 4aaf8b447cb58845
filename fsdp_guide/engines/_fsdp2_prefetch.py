"""FSDP2's explicit prefetch: which blocks each block gathers ahead (private)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fsdp_guide.engines._step import StepPeak, StepSizes


def check_prefetch(name: str, value: object) -> int:
    """``value`` as a prefetch count, or a ``ValueError`` that says what to give instead."""
    # A bool is an int to Python, but True here is FSDP1's switch, not a count of blocks.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fsdp1 = "forward_prefetch=True" if name == "forward_prefetch" else "'BACKWARD_PRE'"
        raise ValueError(
            f"FSDP2's {name} is how many blocks each block gathers ahead: give an int >= 0 "
            f"(0 keeps FSDP2's own order; FSDP1's {fsdp1} is 1), got {value!r}"
        )
    return value


def set_prefetch(blocks: Sequence[nn.Module], *, forward: int = 0, backward: int = 0) -> None:
    """Have each of ``blocks`` (units, in forward order) gather ``forward`` next blocks as its
    forward starts and ``backward`` previous ones as its backward starts.

    A count of ``0`` leaves that pass to FSDP2's own order (each block gathered as it
    starts, and in backward the next one ahead). The last blocks prefetch what is left.

    Raises:
        ValueError: A count that is not an int >= 0.

    Examples:
        >>> set_prefetch([], forward=-1)
        Traceback (most recent call last):
        ...
        ValueError: FSDP2's forward_prefetch is how many blocks each block gathers ahead: ...
    """
    forward = check_prefetch("forward_prefetch", forward)
    backward = check_prefetch("backward_prefetch", backward)
    units: list[Any] = list(blocks)
    for index, block in enumerate(units):
        if forward:
            block.set_modules_to_forward_prefetch(units[index + 1 : index + 1 + forward])
        if backward and index:  # the first block has none before it: FSDP2's own is the same
            # Nearest first: backward reaches block index - 1, then index - 2, ...
            block.set_modules_to_backward_prefetch(units[max(index - backward, 0) : index][::-1])


def forward_prefetch_peak(
    sizes: StepSizes, forward_prefetch: int, reshard_after_forward: bool | int
) -> StepPeak | None:
    """The most held in forward with ``forward_prefetch``: at block ``i`` of ``n``, the
    activations of blocks ``0..i``, the root, block ``i`` and its copy-out buffer, and the
    buffers of the blocks after it that it prefetched; ``None`` without forward prefetch."""
    n = sizes.blocks
    if not forward_prefetch or not n:
        return None
    # Resharded to a 1 / k share, the blocks done so far keep theirs until backward.
    share = 0 if reshard_after_forward is True else int(reshard_after_forward)
    best = (0, 0)
    for index in range(n):
        ahead = min(forward_prefetch, n - 1 - index)
        held = sizes.activations * (index + 1) // n + (2 + ahead) * sizes.largest_unit
        held += index * sizes.largest_unit // share if share else 0
        best = max(best, (held, ahead))
    held, ahead = best
    return StepPeak(
        bytes=held + sizes.root_unit,
        phase="forward",
        kind="activations so far + root + a block gathered + its all-gather buffer"
        + f" + {ahead} prefetched",
    )
