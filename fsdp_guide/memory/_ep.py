"""What expert parallelism leaves on each rank, and what its all-to-alls send (private).

Expert parallelism spreads each mixture-of-experts layer's ``E`` experts over ``e`` ranks
(``E / e`` each), within the data-parallel ranks: consecutive ranks form an expert-parallel
group. A rank routes its tokens, sends each to the rank holding its expert (an all-to-all),
computes what it received with its experts and sends the results back (a second all-to-all);
backward mirrors both. The weights are then laid out two ways, as torchtitan lays them out:
the dense layers by the strategy over all ``dp`` data-parallel ranks, each rank's experts
over the ``dp / e`` ranks that hold the same experts (the same position in their group).

FSDP2 shards each tensor along its first dimension, the experts': when a rank holds fewer
experts than the ranks that shard them, the shards are padded and some ranks hold a whole
expert (torchtitan then shards the experts along another dimension). The plan follows
``fully_shard``'s default, as the runs of :func:`fsdp_guide.parallel.train_expert_parallel` do.

Experts are found as a module with an int ``num_experts`` whose own parameters include a
weight per expert, ``(num_experts, out, in)`` (transformers' grouped experts: Mixtral's,
Qwen-MoE's); its parameters with ``num_experts`` rows are the experts'.

**All-to-all payload**, counted as ``count_collectives`` counts it (each call's input): per
layer and step, ``E`` routing counts, then ``H`` features of each token copy sent and of
each one received, in forward and again in backward: ``E + 2·H·(sent + received)``. A rank
sends ``tokens · top_k`` copies; what it receives depends on the router. Planned from the
routing counts when given (the tokens each rank of a group sends each expert), otherwise
for a balanced router, where every rank receives as many as it sends.

The activations depend on the routing too (the tokens a rank's experts compute), so they are
not traced: measure one rank's forward (:func:`fsdp_guide.wrap.saved_activation_bytes`) and
pass its bytes as ``activations=``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from fsdp_guide.engines import ModelShape
from fsdp_guide.errors import PlanError

if TYPE_CHECKING:
    from fsdp_guide.engines import Engine
    from fsdp_guide.memory._dimensions import RankModel
    from fsdp_guide.memory._request import PlanRequest


@dataclass(frozen=True)
class MoELayer:
    """One mixture-of-experts layer as the planner sees it.

    Attributes:
        name: The experts module's name in the model.
        num_experts: ``E``.
        hidden: Features of a token entering and leaving the experts, ``H``.
        top_k: Experts each token is sent to.
    """

    name: str
    num_experts: int
    hidden: int
    top_k: int


def _top_k(model: nn.Module, parent: nn.Module) -> int | None:
    for source in (parent, getattr(parent, "gate", None), getattr(model, "config", None)):
        for attribute in ("top_k", "num_experts_per_tok"):
            value = getattr(source, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The mixture-of-experts layers of ``model``, in module order.

    Raises:
        PlanError: For experts whose width or ``top_k`` cannot be read.

    Examples:
        >>> moe_layers(nn.Linear(2, 2))
        []
    """
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            continue
        own = [p for p in module.parameters(recurse=False) if p.dim() and p.shape[0] == experts]
        if not any(p.dim() == 3 for p in own):  # a router's (E, H) weight is not experts
            continue
        hidden = getattr(module, "hidden_dim", getattr(module, "hidden_size", None))
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        top_k = _top_k(model, parent)
        if not isinstance(hidden, int) or top_k is None:
            raise PlanError(
                f"{name} ({type(module).__name__}) holds {experts} experts, but its token width "
                "(hidden_dim) or experts per token (top_k) cannot be read"
            )
        found.append(MoELayer(name=name, num_experts=experts, hidden=hidden, top_k=top_k))
    return found


def check_expert_parallel(
    expert_parallel: object,
    routing: object,
    model: nn.Module,
    engine: Engine,
    ranks: int,
    activations: int | None,
) -> tuple[int, Routing | None]:
    """``expert_parallel`` and ``expert_routing`` checked against the model and the ranks.

    Raises:
        PlanError: A degree that is not an int dividing the data-parallel ``ranks``, a dense
            model, experts that do not divide by it, a strategy other than plain FSDP2, no
            ``activations``, or a routing that is not ``e`` rows of ``E`` counts.
    """
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int):
        raise PlanError(f"expert_parallel must be an int >= 1, got {expert_parallel!r}")
    e = expert_parallel
    if e < 1 or ranks % e:
        raise PlanError(
            f"expert_parallel={e} must be >= 1 and divide the {ranks} data-parallel ranks"
        )
    if e == 1:
        if routing is not None:
            raise PlanError("expert_routing is the routing of expert_parallel > 1: pass both")
        return 1, None
    layers = moe_layers(model)
    if not layers:
        raise PlanError(
            f"{type(model).__name__} is a dense model: expert_parallel needs mixture-of-experts "
            "layers (a module with num_experts and a weight per expert)"
        )
    for layer in layers:
        if layer.num_experts % e:
            raise PlanError(
                f"{layer.name} has {layer.num_experts} experts, not divisible by "
                f"expert_parallel={e}: choose a degree that divides them"
            )
    hybrid = "all_reduce" in engine.collectives(ranks, ranks).payload
    if engine.name != "fsdp2" or hybrid:
        raise PlanError(
            "expert parallelism is planned with strategy='fsdp2' (experts sharded over the "
            f"ranks that hold them, the rest over all), not {engine.name!r}"
        )
    if activations is None:
        raise PlanError(
            "expert_parallel needs the bytes one rank's forward saves, measured with "
            "saved_activation_bytes, as activations= (on the command line, --activations): "
            "what a rank's experts compute depends on the routing"
        )
    return e, _check_routing(routing, e, layers)


Routing = tuple[tuple[tuple[int, ...], ...], ...]


def _check_routing(routing: object, e: int, layers: list[MoELayer]) -> Routing | None:
    """The routing of each layer, ``[layer][rank][expert]``: one routing given for every
    layer, or one per layer."""
    if routing is None:
        return None
    table = _as_table(routing)
    depth = 2 if table and all(isinstance(n, int) for row in table for n in row) else 3
    per_layer = [table] * len(layers) if depth == 2 else [_as_table(t) for t in table]
    if depth == 3 and len(per_layer) != len(layers):
        raise PlanError(
            f"expert_routing has {len(per_layer)} layers' routings; the model has "
            f"{len(layers)} mixture-of-experts layers (give one routing, or one per layer)"
        )
    for layer, rows in zip(layers, per_layer, strict=False):
        counts = [n for row in rows for n in row]
        if (
            len(rows) != e
            or any(len(row) != layer.num_experts for row in rows)
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts)
        ):
            raise PlanError(
                f"expert_routing must be {e} rows (one per expert-parallel rank) of "
                f"{layer.num_experts} token counts >= 0 (one per expert of {layer.name})"
            )
    return tuple(tuple(tuple(int(n) for n in row) for row in rows) for rows in per_layer)


def _as_table(value: object) -> tuple[Any, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"expert_routing must be nested sequences of counts, got {value!r}")
    return tuple(tuple(row) if isinstance(row, Sequence) else (row,) for row in value)


def all_to_all_elements(
    layer: MoELayer, tokens: int, e: int, routing: Sequence[Sequence[int]] | None
) -> tuple[int, ...]:
    """All-to-all payload of one layer per step, for each rank of an expert-parallel group.

    Examples:
        >>> layer = MoELayer(name="experts", num_experts=4, hidden=8, top_k=2)
        >>> all_to_all_elements(layer, tokens=10, e=2, routing=None)  # 20 copies each way
        (644, 644)
        >>> all_to_all_elements(layer, 10, 2, [[20, 0, 0, 0], [10, 10, 0, 0]])  # rank 0 busy
        (964, 324)
    """
    per_rank = layer.num_experts // e
    if routing is None:
        received = sent = [tokens * layer.top_k] * e
    else:
        sent = [sum(row) for row in routing]
        received = [
            sum(row[x] for row in routing for x in range(r * per_rank, (r + 1) * per_rank))
            for r in range(e)
        ]
    return tuple(
        layer.num_experts + 2 * layer.hidden * (s + r) for s, r in zip(sent, received, strict=True)
    )


def cut_experts(request: PlanRequest, rank: RankModel) -> RankModel:
    """Each rank keeps ``E / e`` experts of every layer, laid out over ``dp / e`` ranks, and
    the all-to-alls that carry the tokens to them and back."""
    e = request.expert_parallel
    if e == 1:
        return rank
    model = copy.deepcopy(rank.model)
    layers = moe_layers(model)
    units = []
    for layer in layers:
        module = model.get_submodule(layer.name)
        local = []
        for name, param in list(module._parameters.items()):
            if param is not None and param.dim() and param.shape[0] == layer.num_experts:
                local.append((layer.num_experts // e, *param.shape[1:]))
                del module._parameters[name]  # laid out apart, over the ranks holding them
        units.append(tuple(local))
    tokens = request.batch_size * rank.seq_len
    by_rank = [0] * e
    routings = request.expert_routing or (None,) * len(layers)
    for layer, routing in zip(layers, routings, strict=True):
        for r, n in enumerate(all_to_all_elements(layer, tokens, e, routing)):
            by_rank[r] += n
    cut = replace(
        rank,
        model=model,
        experts=ModelShape(units=((), *units)),
        expert_ranks=request.data_parallel // e,
        all_to_all=tuple(by_rank),
    )
    return cut.adding({"all_to_all": max(by_rank)}, e)


def expert_group_position(rank: int, request: Any) -> tuple[int, int]:
    """(position in its expert-parallel group, index among the ranks holding its experts) of
    a rank, for a row-major ``(dp, tp)`` mesh whose ``dp`` is ``(dp / e, e)``."""
    dp_rank = rank // request.tensor_parallel
    return dp_rank % request.expert_parallel, dp_rank // request.expert_parallel
