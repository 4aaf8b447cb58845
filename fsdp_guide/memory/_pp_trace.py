"""A pipeline's stages traced on fake tensors: their boundaries and what they save (private).

Each stage's forward runs as torch's pipeline runs it: the first stage on views of the batch
(torch splits it into micro-batches with ``tensor_split``), the others on a new input that
requires its gradient, as a received activation does, and the last with the loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from fsdp_guide.errors import PlanError
from fsdp_guide.memory._request import PlanRequest
from fsdp_guide.memory._trace import (
    _checkpoint,
    _default_batch,
    _make_batch,
    _meta_copy,
    _OnRealData,
    _quiet_tracer,
    _to_fake,
)


def _chunks(tree: Any, count: int, index: int) -> Any:
    """Micro-batch ``index`` of ``count``: views along the first dimension, as torch splits."""
    return pytree.tree_map_only(Tensor, lambda t: t.tensor_split(count)[index], tree)


def _batch(request: PlanRequest) -> tuple[Any, Any]:
    """The data-parallel group's batch, real when small (see ``_make_batch``)."""
    make = request.batch or _default_batch(request.model)
    return _make_batch(make, request.batch_size, request.seq_len)  # type: ignore[no-any-return]


#: Shape and dtype of each stage's output for one micro-batch.
Boundaries = list[tuple[tuple[int, ...], torch.dtype]]


def stage_boundaries(request: PlanRequest, modules: Sequence[nn.Module]) -> Boundaries:
    """Shape and dtype of the output of each stage of ``modules`` (every stage, in order) for
    one micro-batch, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_guide.outputs import call_model

    stages = [_meta_copy(s) for s in modules]
    found = []
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet_tracer():
        for stage in stages:
            _to_fake(stage)
        inputs, _ = _batch(request)
        with _OnRealData(), torch.no_grad():
            x = _chunks(inputs, request.microbatches, 0)
            for index, stage in enumerate(stages):
                try:
                    x = call_model(stage, x)
                except (RuntimeError, TypeError, ValueError) as exc:
                    raise PlanError(f"cannot trace pipeline stage {index}: {exc}") from exc
                if not isinstance(x, Tensor):
                    raise PlanError(
                        f"pipeline stage {index} returns {type(x).__name__}: a stage boundary "
                        "must be one tensor"
                    )
                found.append((tuple(x.shape), x.dtype))
    return found


def boundary_elements(boundaries: Boundaries) -> tuple[int, ...]:
    """Elements of each stage's output for one micro-batch (what its forward sends)."""
    return tuple(math.prod(shape) for shape, _ in boundaries)


def traced_in_flight(
    request: PlanRequest,
    modules: Mapping[int, nn.Module],
    counts: Mapping[int, int],
    boundaries: Boundaries,
) -> int:
    """Bytes autograd holds for ``counts[s]`` micro-batches in flight on each stage ``s``.

    Each stage's forward (and the loss, on the last stage) runs on fake tensors for its first
    ``counts[s]`` micro-batches: the first stage on views of the batch, the others on a new
    input requiring its gradient, as a received activation does; what they save is counted
    once per storage (:func:`fsdp_guide.wrap.saved_activation_bytes`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_guide.outputs import call_model, output_loss
    from fsdp_guide.wrap import saved_activation_bytes

    stages = [s for s in sorted(counts) if counts[s]]
    if not stages:
        return 0
    last = request.pipeline_parallel * request.stages_per_rank - 1
    traced = nn.ModuleList(_meta_copy(modules[s]) for s in stages)
    if request.checkpointing is not None:
        for stage in traced:
            _checkpoint(stage, request.checkpointing)
    m = request.microbatches
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet_tracer():
        _to_fake(traced)
        inputs, targets = _batch(request)

        def forward() -> Tensor:
            ends: list[Tensor] = []
            for module, s in zip(traced, stages, strict=True):
                for i in range(counts[s]):
                    if s == 0:
                        x = _chunks(inputs, m, i)
                    else:
                        shape, dtype = boundaries[s - 1]
                        x = torch.empty(shape, dtype=dtype, requires_grad=dtype.is_floating_point)
                    out = call_model(module, x)
                    if s == last:
                        ends.append(output_loss(out, _chunks(targets, m, i)))
                    else:  # keeps the stage's graph alive, saving nothing more
                        ends.append(out.sum())
            return sum(ends[1:], ends[0])

        try:
            with _OnRealData():
                nbytes, _ = saved_activation_bytes(traced, forward)
        except PlanError:
            raise
        except (RuntimeError, TypeError, ValueError) as exc:
            raise PlanError(f"cannot trace the pipeline stages {stages}: {exc}") from exc
    return nbytes
