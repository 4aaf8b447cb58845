"""``plan()``'s pipeline keywords, checked once (private).

Each refusal is one line naming the fix, raised before anything is traced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fsdp_guide.errors import PlanError
from fsdp_guide.memory._schedule import canonical_schedule, pipeline_schedule


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_pipeline(
    model: nn.Module,
    *,
    name: str,
    settings: Mapping[str, Any] | None,
    world_size: int,
    tensor_parallel: int,
    batch_size: int,
    precision: str,
    sequence_parallel: bool,
    pipeline_parallel: object,
    microbatches: object,
    schedule: object,
    stages_per_rank: object,
) -> dict[str, Any]:
    """The pipeline fields of a :class:`PlanRequest`, checked.

    Raises:
        PlanError: For a degree, micro-batch count or schedule that is not one, a world that
            is not ``pp x dp x tp`` ranks, micro-batches that do not divide the batch, more
            stages than layers, and what the pipeline is not planned with (a strategy other
            than ddp or fsdp2, FSDP2 resharding after forward, mixed precision, sequence
            parallelism).
    """
    from fsdp_guide.memory._pp import PIPELINE_STRATEGIES, pipeline_layers, stage_bounds

    pp = _count("pipeline_parallel", pipeline_parallel)
    if pp == 1:
        given = {"microbatches": microbatches, "schedule": schedule}
        given["stages_per_rank"] = stages_per_rank
        extra = sorted(k for k, v in given.items() if v is not None)
        if extra:
            raise PlanError(f"{', '.join(extra)} need pipeline_parallel > 1")
        return {}
    if world_size % (pp * tensor_parallel):
        raise PlanError(
            f"world_size={world_size} is not a product of pipeline_parallel={pp} x "
            f"tensor_parallel={tensor_parallel} x data-parallel ranks: choose degrees that "
            "divide it"
        )
    dp = world_size // (pp * tensor_parallel)
    if name not in PIPELINE_STRATEGIES or (dp > 1 and name != "fsdp2"):
        raise PlanError(
            f"pipeline parallelism is planned with strategy='fsdp2' on the data-parallel "
            f"ranks (or 'ddp' when there is one, which wraps nothing), not {name!r}"
        )
    if settings and settings.get("reshard_after_forward", False) is not False:
        raise PlanError(
            "pipeline parallelism runs FSDP2 with reshard_after_forward=False (each "
            "micro-batch would gather its stage again): leave the setting out"
        )
    if precision != "fp32":
        raise PlanError("pipeline parallelism is planned in fp32: pass precision='fp32'")
    if sequence_parallel:
        raise PlanError("sequence_parallel is not planned with pipeline_parallel > 1")
    m = pp if microbatches is None else _count("microbatches", microbatches)
    if batch_size % m:
        raise PlanError(
            f"microbatches={m} does not divide batch_size={batch_size}: each micro-batch "
            "takes batch_size / microbatches samples"
        )
    canonical = canonical_schedule(schedule or "1F1B")
    if stages_per_rank is not None:
        _count("stages_per_rank", stages_per_rank)
    checked = pipeline_schedule(
        canonical,
        ranks=pp,
        microbatches=m,
        stages_per_rank=stages_per_rank,  # type: ignore[arg-type]
    )
    stage_bounds(len(pipeline_layers(model)), checked.stages)
    return {
        "pipeline_parallel": pp,
        "microbatches": m,
        "schedule": canonical,
        "stages_per_rank": checked.stages_per_rank,
    }
