"""Model state per rank to the byte, from parameter shapes and the strategy's engine (private).

The ZeRO formulas (:func:`~fsdp_guide.memory.estimate_model_state`) split ``Ψ`` evenly. The
implementations do not, and :func:`state_per_rank` follows what each engine of the catalog
(:attr:`~fsdp_guide.catalog.StrategySpec.engine`) allocates, as the catalog's setup
functions build it:

- ``ddp``: every rank holds every tensor.
- ``zero``, ``oss``, ``sharded_ddp``: the optimizer owns whole tensors; each tensor, largest
  first, goes to the rank with the fewest elements so far (ZeroRedundancyOptimizer's rule,
  and OSS's with the parameters handed largest first), so the shards differ by rank.
  ShardedDDP without buckets keeps only the gradients of the tensors its rank owns.
- ``fsdp1``, ``fairscale_fsdp``: one flat parameter for the model, cut into ``N`` equal
  chunks of ``ceil(Ψ / N)`` elements, the last ones zero-padded; the optimizer sees one
  tensor.
- ``fsdp2``: each parameter cut along its first dimension into chunks of ``ceil(d0 / N)``
  rows; parameters and gradients keep the padded chunk, Adam's moments only the rows this
  rank really has (none on some ranks).

Adam (``torch.optim.Adam``, neither fused nor capturable) adds a 4-byte ``step`` tensor per
tensor it updates. An engine not listed here (a strategy added to the catalog later) gets
the ZeRO formula on every rank, marked as not exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from fsdp_guide.catalog._table import StrategySpec
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._zero import (
    OptimizerName,
    Precision,
    bytes_per_param,
    estimate_model_state,
)

#: Engines whose per-rank layout :func:`state_per_rank` knows to the byte.
EXACT_ENGINES = frozenset({"ddp", "zero", "oss", "sharded_ddp", "fsdp1", "fsdp2", "fairscale_fsdp"})

# Adam's step counter: a 0-d fp32 tensor per parameter it updates.
_STEP_BYTES = {"adam": 4, "sgd": 0, "sgd_momentum": 0}


def greedy_partition(numels: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of the tensors each rank owns: largest first, to the rank with fewest elements.

    Ties keep the model's order (a stable sort) and go to the lowest rank, as in
    ZeroRedundancyOptimizer and OSS. Only the first ``min(ranks, len(numels))`` ranks can
    own anything, and only those are returned.

    Examples:
        >>> greedy_partition([4, 10, 4, 1], 2)
        [[1], [0, 2, 3]]
        >>> greedy_partition([4, 10], 1000)
        [[1], [0]]
    """
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    active = min(ranks, len(numels))
    owned: list[list[int]] = [[] for _ in range(active)]
    heap = [(0, rank) for rank in range(active)]  # (elements so far, rank): a valid heap
    for index in order:
        size, rank = heapq.heappop(heap)
        owned[rank].append(index)
        heapq.heappush(heap, (size + numels[index], rank))
    return [sorted(indices) for indices in owned]


def _rows_per_shard(shapes: Sequence[Sequence[int]], group: int) -> tuple[int, list[int]]:
    """FSDP2: padded elements per shard, and the elements each shard really has.

    A parameter of ``r`` rows of ``w`` elements is cut into chunks of ``c = ceil(r / N)``
    rows: the first ``r // c`` shards get ``c`` rows, the next the remainder, the rest none.
    A difference array adds that up for all shards at once.
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
    local = list(itertools.accumulate(diff[:group]))
    return padded, local


def state_per_rank(
    spec: StrategySpec,
    shapes: Sequence[Sequence[int]],
    world_size: int,
    precision: Precision = "fp32",
    optimizer: OptimizerName = "adam",
) -> tuple[tuple[ModelState, ...], bool]:
    """The model state each rank holds after ``optimizer.step()``, and whether it is exact.

    Args:
        spec: The strategy.
        shapes: The shape of each parameter, in ``model.parameters()`` order.
        world_size: Ranks.
        precision: ``"fp32"`` or ``"mixed"``: bytes per element of each kind of state
            (:func:`~fsdp_guide.memory.bytes_per_param`). Only fp32 is measured here;
            ``"mixed"`` applies ZeRO's byte counts to the same layout.
        optimizer: ``"adam"``, ``"sgd"`` or ``"sgd_momentum"``.

    Returns:
        One :class:`~fsdp_guide.memory.ModelState` per rank, and ``True`` when the
        engine's layout is known (else each rank gets the ZeRO formula).

    Examples:
        Two tensors of 10 and 7 elements (17 in all) on 2 ranks, fp32 Adam:

        >>> from fsdp_guide.catalog import STRATEGIES
        >>> states, exact = state_per_rank(STRATEGIES["zero1"], [(10,), (7,)], 2)
        >>> [s.optimizer for s in states], exact  # 8 bytes per element + a 4-byte step each
        ([84, 60], True)
        >>> [s.params for s in state_per_rank(STRATEGIES["fsdp"], [(10,), (7,)], 2)[0]]
        [36, 36]
        >>> [s.optimizer for s in state_per_rank(STRATEGIES["fsdp2"], [(10,), (7,)], 2)[0]]
        [80, 72]
    """
    per = bytes_per_param(precision, optimizer)
    step = _STEP_BYTES[optimizer]
    group = spec.shard_group_size(world_size)
    numels = [math.prod(shape) for shape in shapes]
    total = sum(numels)
    # The coordinate of each rank in its shard group (HYBRID_SHARD's mesh is row-major).
    shard_of = [rank % group for rank in range(world_size)]
    if spec.engine == "ddp":
        one = ModelState(
            per.params * total, per.grads * total, per.optimizer * total + step * len(numels)
        )
        return tuple(one for _ in shard_of), True
    if spec.engine in ("zero", "oss", "sharded_ddp"):
        owned = greedy_partition(numels, group)
        by_shard = []
        for shard in range(min(group, len(owned) + 1)):  # every shard past the owners: nothing
            mine = owned[shard] if shard < len(owned) else []
            elements = sum(numels[i] for i in mine)
            grads = elements if spec.stage_at_step >= 2 and not spec.full_grads else total
            by_shard.append(
                ModelState(
                    per.params * total,
                    per.grads * grads,
                    per.optimizer * elements + step * len(mine),
                )
            )
        return tuple(by_shard[min(shard, len(by_shard) - 1)] for shard in shard_of), True
    if spec.engine in ("fsdp1", "fairscale_fsdp"):
        flat = math.ceil(total / group) if spec.stage_at_step >= 3 else total
        one = ModelState(per.params * flat, per.grads * flat, per.optimizer * flat + step)
        return tuple(one for _ in shard_of), True
    if spec.engine == "fsdp2":
        padded, local = _rows_per_shard(shapes, group)
        distinct: dict[int, ModelState] = {}
        states = []
        for shard in shard_of:
            elements = local[shard]
            if elements not in distinct:
                distinct[elements] = ModelState(
                    per.params * padded,
                    per.grads * padded,
                    per.optimizer * elements + step * len(numels),
                )
            states.append(distinct[elements])
        return tuple(states), True
    if spec.engine == "deepspeed" and (precision, optimizer) == ("fp32", "adam"):
        # DeepSpeed's own layout (master copy, padded partitions), measured for fp32 Adam.
        one = spec.predict(total, world_size, numels)
        return tuple(one for _ in shard_of), True
    formula = estimate_model_state(
        total, group, spec.stage_at_step, precision, optimizer, full_grads=spec.full_grads
    )
    return tuple(formula for _ in shard_of), False
