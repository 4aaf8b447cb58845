"""DeepSpeed's own layout of the ZeRO stages, in elements per rank (private).

:func:`deepspeed_layout` is what :class:`fsdp_guide.engines.DeepSpeedZero` answers for a
model's parameter sizes; the byte counts are
:func:`fsdp_guide.memory.estimate_deepspeed_state`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fsdp_guide.engines._records import Layout
from fsdp_guide.launcher import check_world_size

#: DeepSpeed's default ``reduce_bucket_size`` (elements).
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000


def _check_numels(param_numels: int | Sequence[int]) -> list[int]:
    numels = [param_numels] if isinstance(param_numels, int) else list(param_numels)
    if not numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numels):
        raise ValueError(
            "param_numels must be a positive int or a non-empty sequence of them (the sizes "
            f"of the parameter tensors), got {param_numels!r}"
        )
    return numels


def deepspeed_layout(
    param_numels: int | Sequence[int],
    world_size: int,
    stage: int,
    *,
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> Layout:
    """What a rank of a DeepSpeed engine holds after ``engine.step()``, in elements.

    The byte counts, their table and the assumptions are those of
    :func:`fsdp_guide.memory.estimate_deepspeed_state`, which multiplies these by fp32's 4
    bytes (8 for Adam's two moments). In bf16 the elements are the same: DeepSpeed pads and
    partitions as in fp32, and only the bytes per element change (see
    :class:`DeepSpeedZero`).

    Raises:
        ValueError: For bad sizes, world size or stage, or an offload the stage lacks.
    """
    numels = _check_numels(param_numels)
    check_world_size(world_size)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(reduce_bucket_size, bool) or not isinstance(reduce_bucket_size, int):
        raise ValueError(f"reduce_bucket_size must be an int, got {reduce_bucket_size!r}")
    if reduce_bucket_size < 1:
        raise ValueError(f"reduce_bucket_size must be >= 1 element, got {reduce_bucket_size}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")
    total = sum(numels)
    if stage == 0:
        return Layout(params=total, grads=0, optimizer=total, steps=len(numels))
    if stage == 3:
        shard = sum(math.ceil(n / world_size) for n in numels)
        return Layout(
            params=shard,
            master=shard,
            grads=shard,
            master_grads=shard if offload_optimizer else 0,
            buckets=reduce_bucket_size,
            optimizer=shard,
            steps=1,
        )
    alignment = 2 * world_size  # two 16-bit elements: 4-byte aligned partition starts
    padded = math.ceil(total / alignment) * alignment
    partition = padded // world_size
    offloaded = 1 if offload_optimizer else 0
    return Layout(
        params=padded + offloaded * partition,  # a partition waiting for the all-gather
        master=partition,
        grads=0,
        master_grads=partition * offloaded,
        buckets=2 * max(numels) * offloaded,  # two staging buffers of the largest tensor
        optimizer=partition,
        steps=1,
    )


# The engine's stage-3 settings and the ``zero_optimization`` keys they set.
