"""FSDP2's per-parameter arithmetic and state: row chunks, and the unsharded gradients kept
while gradient sync is off (private)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def rows_per_shard(shapes: Sequence[Sequence[int]], group: int) -> tuple[int, list[int]]:
    """Padded elements per shard, and the elements each of the ``group`` shards really has.

    A parameter of ``r`` rows of ``w`` elements is cut into chunks of ``c = ceil(r / N)``
    rows: the first ``r // c`` shards get ``c`` rows, the next the remainder, the rest none.
    A difference array adds that up for all shards at once.

    Examples:
        >>> rows_per_shard([(3, 2)], 2)  # chunks of 2 rows: 4 elements, then 2
        (4, [4, 2])
    """
    padded = 0
    diff = [0] * (group + 1)
    for shape in shapes:
        rows = shape[0] if len(shape) else 1  # a 0-d parameter is one row of one
        width = math.prod(shape) // rows if rows else 0
        chunk = math.ceil(rows / group)
        padded += chunk * width
        if chunk == 0:
            continue
        full, rest = divmod(rows, chunk)
        diff[0] += chunk * width
        diff[full] -= chunk * width
        if rest:
            diff[full] += rest * width
            diff[full + 1] -= rest * width
    return padded, list(itertools.accumulate(diff[:group]))


def unsharded_grads(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 keeps while ``set_requires_gradient_sync(False)``
    holds back the reduce-scatter: in the reduce dtype when it differs from the
    parameters' (``unsharded_accumulated_grad``), else on the unsharded parameter."""
    fsdp_module = _fsdp_module()
    held: list[torch.Tensor] = []
    for sub in module.modules():
        if not isinstance(sub, fsdp_module):
            continue
        group = getattr(sub._get_fsdp_state(), "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            accumulated = getattr(param, "unsharded_accumulated_grad", None)
            unsharded = getattr(param, "_unsharded_param", None)
            for grad in (accumulated, getattr(unsharded, "grad", None)):
                if isinstance(grad, torch.Tensor):
                    held.append(grad)
    return held


def _fsdp_module() -> type[Any]:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule
