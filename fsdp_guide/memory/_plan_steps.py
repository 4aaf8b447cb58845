"""The steps :func:`fsdp_guide.memory.plan` composes over one request (private).

Each reads the :class:`~fsdp_guide.memory._request.PlanRequest` and the model one rank
computes (:func:`~fsdp_guide.memory._dimensions.rank_model`): its units, each rank's model
state, the activations, the communication per step and the sizes the step peak reads.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from fsdp_guide.comm import CommPrediction, predict_communication
from fsdp_guide.engines import (
    ModelShape,
    StepSizes,
    follows_units,
    model_shape,
    module_calls,
    unit_names,
    unit_summary,
)
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._accumulation import gradient_payload
from fsdp_guide.memory._dimensions import RankModel
from fsdp_guide.memory._predict import state_per_rank
from fsdp_guide.memory._request import PlanRequest
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._trace import traced_activation_bytes
from fsdp_guide.memory._trainable import with_frozen


def unit_sizes(shape: ModelShape) -> tuple[int, int]:
    """(largest unit, root unit) parameters of ``shape``."""
    sizes = [sum(math.prod(s) for s in unit) for unit in shape.units]
    return max(sizes), sizes[0]


def units(request: PlanRequest, rank: RankModel) -> tuple[ModelShape, str]:
    """The rank's model cut into units by the request's policy, and that cut in words for
    an engine whose figures follow it."""
    try:
        names = unit_names(rank.model, request.policy)
        shape = model_shape(rank.model, request.policy)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    if not follows_units(request.engine):
        return shape, ""
    return shape, unit_summary(rank.model, names, request.policy)


def model_state(
    request: PlanRequest, shape: ModelShape, rank: RankModel
) -> tuple[tuple[ModelState, ...], bool]:
    """Each rank's state after the optimizer step, and whether it is the engine's to the byte.

    The engine lays the state out over the data-parallel ranks; the mesh is row-major, so
    the ``tensor_parallel`` ranks of a group share their data-parallel rank's layout. Experts
    laid out apart (expert parallelism) add the layout of the ranks holding the same ones.
    Frozen parameters are weights only: the gradients and optimizer state are those of
    the trainable ones.
    """
    args = (request.engine, shape, request.data_parallel, request.precision, request.optimizer)
    by_dp, exact = state_per_rank(*args)
    if request.frozen_params:
        trainable = model_shape(rank.model, request.policy, trainable_only=True)
        by_dp = with_frozen(by_dp, state_per_rank(request.engine, trainable, *args[2:])[0])
    tp, dp = request.tensor_parallel, request.data_parallel
    states = [by_dp[r // tp % dp] for r in range(request.world_size)]
    if rank.experts is not None:
        by_group, exact_experts = state_per_rank(
            request.engine, rank.experts, rank.expert_ranks, request.precision, request.optimizer
        )
        e = request.expert_parallel
        states = [add_states(s, by_group[(r // tp) // e]) for r, s in enumerate(states)]
        exact = exact and exact_experts
    return tuple(states), exact


def add_states(a: ModelState, b: ModelState) -> ModelState:
    """Two states held together, field by field."""
    return ModelState(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a) if f.init}
    )


def activations(request: PlanRequest, rank: RankModel) -> int:
    """The bytes autograd saves in the rank's forward: given, or traced on fake tensors."""
    if request.activations is not None:
        return request.activations
    if request.pipeline_parallel > 1:  # the schedule's peak, set when the plans combine
        return 0
    return traced_activation_bytes(
        rank.model,
        request.batch_size,
        rank.seq_len,
        precision=request.precision,
        activation_checkpointing=request.checkpointing,
        batch=request.batch,
        mixed="params" if request.engine.mixed_precision == "params" else "autocast",
    )


def communication(request: PlanRequest, rank: RankModel, shape: ModelShape) -> CommPrediction:
    """The engine's collectives over the data-parallel ranks, and those the cuts add."""
    predicted = predict_communication(
        request.strategy, shape.num_params, request.data_parallel, request.comm_dtype, shape=shape
    )
    gradients = gradient_payload(request, rank)
    if request.frozen_params:  # only the trainable parameters' gradients are reduced
        predicted = replace(predicted, payload={**predicted.payload, **gradients})
    reduce = request.engine.reduce_bytes(predicted.element_size)
    if reduce != predicted.element_size:  # reduced in another dtype than gathered
        predicted = replace(predicted, element_sizes=dict.fromkeys(gradients, reduce))
    if not rank.payload:
        return predicted
    added = dict(rank.payload)
    if rank.experts is not None and rank.expert_ranks > 1:  # the experts' own shards
        experts = predict_communication(
            request.strategy,
            rank.experts.num_params,
            rank.expert_ranks,
            request.comm_dtype,
            shape=rank.experts,
        )
        for kind, elements in experts.payload.items():
            added[kind] = added.get(kind, 0) + elements
    payload = dict(predicted.payload)
    for kind, elements in added.items():
        payload[kind] = payload.get(kind, 0) + elements
    # A kind the engine issues keeps its group; one only the cuts issue takes theirs.
    groups = {k: g for k, g in rank.groups.items() if k not in predicted.payload}
    return replace(
        predicted,
        num_params=sum(p.numel() for p in request.model.parameters()),
        world_size=request.world_size,
        payload=payload,
        group_sizes={**predicted.group_sizes, **groups},
    )


def step_sizes(
    request: PlanRequest, rank: RankModel, shape: ModelShape, activations: int
) -> StepSizes:
    """The sizes the engine's step peak reads, in bytes."""
    per = request.per_param
    largest, root = unit_sizes(shape)
    return StepSizes(
        params=per.params * shape.num_params,
        grads=per.grads * shape.num_params,
        largest_unit=per.params * largest,
        largest_unit_grads=per.grads * largest,
        root_unit=per.params * root,
        activations=activations,
        calls=module_calls(rank.model),
        blocks=len(shape.units) - 1,
    )
