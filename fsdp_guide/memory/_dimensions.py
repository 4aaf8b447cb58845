"""The model one rank computes, after each model-parallel dimension has cut it (private).

A plan starts from the whole model (:class:`RankModel` of :func:`whole`) and lets each
dimension of the mesh cut it in turn (:data:`CUTS`): a pipeline keeps a rank's stages and
adds their messages; tensor parallelism replaces the layers of its plan by a rank's shards
and adds its collectives; context parallelism would keep a rank's share of the sequence.
Whatever is left is sharded (or replicated) by the strategy's engine over the data-parallel
ranks.

Adding a dimension is a field of :class:`~fsdp_guide.memory._request.PlanRequest` and a
function here, ``(request, rank) -> rank``, appended to :data:`CUTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from torch import nn

from fsdp_guide.engines import ModelShape
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._cp import cut_sequence, ring
from fsdp_guide.memory._ep import cut_experts
from fsdp_guide.memory._request import PlanRequest
from fsdp_guide.memory._tp import (
    _style,
    cut_layers,
    local_model,
    sequence_parallel_model,
    sp_elements,
    tp_elements,
    tp_plan_of,
)


@dataclass(frozen=True, kw_only=True)
class RankModel:
    """What one rank computes, and what cutting it sends.

    Attributes:
        model: The rank's model, on the meta device (the whole model when nothing cuts it).
        payload: Elements per collective kind that the cuts add to each step, beyond the
            engine's own.
        groups: Ranks in the group of each of those kinds.
        seq_len: Tokens per sample the rank computes (fewer with context parallelism).
        experts: The shapes of the rank's experts, laid out apart from ``model`` (which
            then holds the dense layers only), one unit per layer after an empty root;
            ``None`` without expert parallelism.
        expert_ranks: Ranks the experts are laid out over (those holding the same ones).
        all_to_all: Each expert-parallel rank's all-to-all elements per step, where the
            routing makes them differ (the payload holds the largest).
    """

    model: nn.Module
    payload: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, int] = field(default_factory=dict)
    seq_len: int = 0
    experts: ModelShape | None = None
    expert_ranks: int = 1
    all_to_all: tuple[int, ...] = ()

    def adding(self, payload: Mapping[str, int], group: int) -> RankModel:
        """This rank with ``payload`` more, each kind over ``group`` ranks."""
        merged = dict(self.payload)
        for kind, elements in payload.items():
            merged[kind] = merged.get(kind, 0) + elements
        return replace(
            self, payload=merged, groups={**self.groups, **dict.fromkeys(payload, group)}
        )


def whole(request: PlanRequest) -> RankModel:
    """The uncut model."""
    return RankModel(model=request.model, seq_len=request.seq_len)


def pipeline_parallel(request: PlanRequest, rank: RankModel) -> RankModel:
    """The stages of the request's pipeline rank, and the messages its schedule sends."""
    from fsdp_guide.memory._pp import pipeline_cut  # it builds on RankModel

    return pipeline_cut(request, rank)


def tensor_parallel(request: PlanRequest, rank: RankModel) -> RankModel:
    """The layers of the tensor-parallel plan cut over ``tensor_parallel`` ranks, and their
    all-reduces (with sequence parallelism: all-gathers and reduce-scatters)."""
    tp = request.tensor_parallel
    if tp == 1:
        return rank
    model = rank.model
    tp_plan = tp_plan_of(model, request.tp_plan)
    if request.pipeline_parallel > 1:
        cut_layers(request.model, tp, tp_plan)  # checked on the whole model
        if not any(_style(name, tp_plan) for name, _ in model.named_modules() if name):
            return rank  # a stage with no layer to cut (the embeddings alone) is replicated
    cut = cut_layers(model, tp, tp_plan)
    b, s = request.batch_size, rank.seq_len
    local = local_model(model, tp, cut)
    if request.sequence_parallel:
        if set(cut.values()) - {"colwise", "rowwise"}:
            raise PlanError(
                "sequence parallelism is planned with a tp_plan of 'colwise' and 'rowwise' "
                f"layers only, got {sorted(set(cut.values()))}"
            )
        payload = sp_elements(model, cut, b, s)
        local = sequence_parallel_model(local, tp, cut)
    else:
        payload = tp_elements(model, cut, b, s)
    return replace(rank, model=local).adding(payload, tp)


#: The cuts, in the order they apply. Context parallelism cuts the sequence first (every
#: other dimension then sees the rank's tokens) and adds its ring last (the K/V the rank's
#: attention computes with, once tensor parallelism has cut the heads); a pipeline keeps the
#: rank's stages before tensor parallelism cuts their layers.
CUTS: tuple[Callable[[PlanRequest, RankModel], RankModel], ...] = (
    cut_sequence,
    pipeline_parallel,
    tensor_parallel,
    ring,
    cut_experts,
)


def rank_model(request: PlanRequest) -> RankModel:
    """The model one rank computes once every dimension has cut it.

    Examples:
        >>> from fsdp_guide.models import MLP
        >>> from fsdp_guide.memory._request import resolve
        >>> request = resolve(MLP(), batch_size=2, seq_len=1, world_size=2, strategy="ddp",
        ...     precision="fp32", activation_checkpointing=None, cpu_offload=False, batch=None,
        ...     optimizer="adam", activations=None, policy="blocks", tensor_parallel=1,
        ...     tp_plan=None, settings=None, sequence_parallel=False)
        >>> rank_model(request).payload
        {}
    """
    rank = whole(request)
    for cut in CUTS:
        rank = cut(request, rank)
    return rank
