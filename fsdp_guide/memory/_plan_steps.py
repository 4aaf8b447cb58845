"""The named steps :func:`fsdp_guide.memory.plan` composes over one resolved request (private).

Each step reads the :class:`~fsdp_guide.memory._request.PlanRequest` and what the steps
before it gave: the rank's model cut into units, each rank's state (on the accelerator and
in host memory), the activations over the step, the communication per optimizer step, the
sizes the engine's step peak reads, and the :class:`Plan` assembled from them. A dimension
added to the request (a field, and what it cuts of the rank's model in ``rank_model``)
reaches every step through it.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from fsdp_guide.comm import CommPrediction, predict_communication
from fsdp_guide.engines import (
    ModelShape,
    StepSizes,
    Transient,
    follows_units,
    model_shape,
    module_calls,
    unit_names,
    unit_summary,
)
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._accumulation import gradient_payload
from fsdp_guide.memory._dimensions import RankModel
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._predict import host_per_rank, state_per_rank
from fsdp_guide.memory._profile import ActivationProfile, remembered, traced_profile
from fsdp_guide.memory._request import PlanRequest
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._trainable import with_frozen


def unit_sizes(shape: ModelShape) -> tuple[int, int]:
    """(largest unit, root unit) parameters of a model shape."""
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
) -> tuple[tuple[ModelState, ...], tuple[ModelState, ...], bool]:
    """Each rank's state after the optimizer step, the part of it in host memory, and
    whether it is the engine's to the byte.

    The engine lays the state out over the data-parallel ranks; the mesh is row-major, so
    the ``tensor_parallel`` ranks of a group share their data-parallel rank's layout. Experts
    laid out apart (expert parallelism) add the layout of the ranks holding the same ones.
    Frozen parameters are weights only: the gradients and optimizer state are those of
    the trainable ones.
    """
    engine, dp, tp = request.engine, request.data_parallel, request.tensor_parallel
    precision, optimizer = request.precision, request.optimizer
    by_dp, exact = state_per_rank(engine, shape, dp, precision, optimizer)
    if request.frozen_params:  # weights only: gradients and optimizer state train
        trainable = model_shape(rank.model, request.policy, trainable_only=True)
        by_dp = with_frozen(by_dp, state_per_rank(engine, trainable, dp, precision, optimizer)[0])
    on_host = host_per_rank(engine, shape, dp, precision, optimizer)
    world = range(request.world_size)
    states = [by_dp[r // tp % dp] for r in world]
    hosts = [on_host[r // tp % dp] for r in world]
    if rank.experts is not None:
        e, ranks = request.expert_parallel, rank.expert_ranks
        by_group, exact_experts = state_per_rank(engine, rank.experts, ranks, precision, optimizer)
        host_group = host_per_rank(engine, rank.experts, ranks, precision, optimizer)
        states = [_add(s, by_group[(r // tp) // e]) for r, s in zip(world, states, strict=True)]
        hosts = [_add(h, host_group[(r // tp) // e]) for r, h in zip(world, hosts, strict=True)]
        exact = exact and exact_experts
    return tuple(states), tuple(hosts), exact


def _add(a: ModelState, b: ModelState) -> ModelState:
    """Two states held together, field by field."""
    return ModelState(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a) if f.init}
    )


def activations(request: PlanRequest, rank: RankModel) -> ActivationProfile | int:
    """What the rank's activations hold over the step, traced on fake tensors (once per
    way of running the model: every strategy that runs it alike shares the trace); or the
    bytes saved for backward the caller gave."""
    if request.activations is not None:
        return request.activations
    if request.pipeline_parallel > 1:  # the schedule's peak, set when the plans combine
        return 0
    policy = request.policy
    key = (
        request.batch_size,
        rank.seq_len,
        request.precision,
        request.mixed_kind,
        request.checkpointing,
        request.batch,
        policy if isinstance(policy, str) else repr(policy),
        request.tensor_parallel,
        request.sequence_parallel,
        None if request.tp_plan is None else tuple(sorted(request.tp_plan.items())),
        request.context_parallel,
        request.cp_layout,
        # Frozen weights save less for backward; the rank's model says which train.
        tuple(n for n, p in rank.model.named_parameters() if not p.requires_grad),
    )
    return remembered(
        request.source,
        key,
        lambda: traced_profile(
            rank.model,
            request.batch_size,
            rank.seq_len,
            precision=request.precision,
            activation_checkpointing=request.checkpointing,
            batch=request.batch,
            mixed="params" if request.mixed_kind == "params" else "autocast",
            policy=policy,
        ),
    )


def communication(request: PlanRequest, rank: RankModel, shape: ModelShape) -> CommPrediction:
    """The engine's collectives over the data-parallel ranks and those the cuts add, in one
    micro-step that reduces the gradients (``plan`` makes them the optimizer step's with
    :func:`plan_accumulation`)."""
    predicted = predict_communication(
        request.strategy,
        shape.num_params,
        request.data_parallel,
        request.comm_dtype,
        shape=shape,
        reduce_dtype=request.reduce_dtype,
        gpus_per_node=request.gpus_per_node,
        engine=request.engine,
    )
    if request.frozen_params:  # only the trainable parameters' gradients are reduced
        gradients = gradient_payload(request, rank)
        predicted = replace(predicted, payload={**predicted.payload, **gradients})
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
    node = request.gpus_per_node
    crossing = tuple(
        k for k in payload if k in predicted.inter_node or (node and groups.get(k, 0) > node)
    )
    return replace(
        predicted,
        num_params=sum(p.numel() for p in request.model.parameters()),
        world_size=request.world_size,
        payload=payload,
        group_sizes={**predicted.group_sizes, **groups},
        inter_node=crossing,
    )


def step_sizes(
    request: PlanRequest,
    rank: RankModel,
    shape: ModelShape,
    profile: ActivationProfile | int,
    ranks: tuple[ModelState, ...],
) -> StepSizes:
    """The sizes the engine's step peak reads, in bytes: the model's, its activations over
    the step (gradient elements made bytes at the engine's precision), and what the
    optimizer step reads and allocates on the fullest rank."""
    per = request.per_param
    _, root = unit_sizes(shape)
    # The largest block: the root unit, kept gathered from forward to backward, apart.
    sizes = [sum(math.prod(s) for s in unit) for unit in shape.units]
    largest = max(sizes[1:], default=sizes[0])
    engine = request.engine
    state = max(ranks, key=lambda s: s.total)
    traced = profile if isinstance(profile, ActivationProfile) else None
    stretches = tuple(
        replace(
            s,
            grads=per.grads * s.grads,
            largest_grad=per.grads * s.largest_grad,
            moments=tuple((a, per.grads * g) for a, g in s.moments),
        )
        for s in (traced.stretches if traced else ())
    )
    if request.optimizer != "adam":  # SGD's momentum updates in place
        temporaries = 0
    elif request.foreach:  # every stepped tensor's sqrt at once: 4 of Adam's 8 bytes
        temporaries = state.optimizer // 2
    else:  # a tensor's sqrt and quotient, the previous one's quotient still bound, fp32
        tensors = engine.stepped_tensors(shape, request.data_parallel)
        temporaries = 4 * max(
            (2 * n + (tensors[i - 1] if i else 0) for i, n in enumerate(tensors)), default=0
        )
    return StepSizes(
        params=per.params * shape.num_params,
        grads=per.grads * shape.num_params,
        largest_unit=per.params * largest,
        largest_unit_grads=per.grads * largest,
        root_unit=per.params * root,
        activations=profile.saved if isinstance(profile, ActivationProfile) else profile,
        calls=module_calls(rank.model),
        blocks=len(shape.units) - 1,
        forward=traced.forward if traced else (),
        stretches=stretches,
        # An optimizer stepping in host memory holds nothing more on the accelerator.
        step_grads=0
        if engine.steps_on_host
        else sum(getattr(state, name) for name in engine.step_gradient_fields),
        optimizer_temporaries=0 if engine.steps_on_host else temporaries,
    )


def assemble(
    request: PlanRequest,
    units: str,
    ranks: tuple[ModelState, ...],
    hosts: tuple[ModelState, ...],
    exact: bool,
    sizes: StepSizes,
    communication: CommPrediction,
    all_to_all: tuple[int, ...] = (),
    held: tuple[int, ...] | None = None,
) -> Plan:
    """The :class:`Plan`: the fullest rank's state, what each rank keeps between steps on
    the accelerator, the engine's transient buffer and step peak. ``held``: the gradient
    bytes each rank holds between micro-steps of gradient accumulation (whole gradients
    while the sync is held back), where they are not its gradient shards."""
    engine, dp = request.engine, request.data_parallel
    num_params = sum(p.numel() for p in request.model.parameters())
    local_params = sizes.params // request.per_param.params
    largest = max(sizes.largest_unit, sizes.root_unit) // request.per_param.params  # root too
    per = request.per_param
    transient = engine.transient(
        param_bytes=per.params, grad_bytes=per.grads, num_params=local_params, largest_unit=largest
    )
    gathered = engine.gathered(sizes, dp)
    if gathered is not None:  # what the engine gathers, known from the modules' order
        transient = Transient(bytes=gathered.peak, kind=gathered.kind)
    state = max(ranks, key=lambda s: s.total)  # the first of the fullest

    def kept(r: ModelState) -> ModelState:  # what zero_grad() leaves
        return replace(
            r,
            grads=r.grads if engine.grads_between_steps else 0,
            buckets=r.buckets if engine.buckets_between_steps else 0,
        )

    between = tuple(kept(r) for r in ranks)
    on_device = tuple(
        0 if request.cpu_offload else b.total - kept(h).total
        for b, h in zip(between, hosts, strict=True)
    )
    peak = engine.step_peak(sizes, dp)
    if request.grad_accumulation > 1 and not engine.grads_between_steps:
        # From the second micro-batch on, the gradients so far are held through its step.
        held = tuple(
            0 if request.cpu_offload else (r.grads if held is None else held[i]) - h.grads
            for i, (r, h) in enumerate(zip(ranks, hosts, strict=True))
        )
        on_device = tuple(k + g for k, g in zip(on_device, held, strict=True))
    fullest = ranks.index(state)
    return Plan(
        strategy=request.strategy,
        world_size=request.world_size,
        num_params=num_params,
        precision=request.precision,
        state=state,
        activations=sizes.activations,
        transient=transient.bytes,
        transient_kind=transient.kind,
        communication=communication,
        cpu_offload=request.cpu_offload,
        ranks=ranks,
        exact_state=exact,
        between_steps=between,
        step_peak=on_device[fullest] + peak.bytes,
        step_peak_phase=peak.phase,
        step_peak_kind=peak.kind,
        tensor_parallel=request.tensor_parallel,
        units=units,
        sequence_parallel=request.sequence_parallel,
        kept_params=0 if gathered is None else gathered.after_forward,
        host_ranks=hosts,
        rank_peaks=tuple(k + peak.bytes for k in on_device),
        context_parallel=request.context_parallel,
        expert_parallel=request.expert_parallel,
        all_to_all=all_to_all,
    )
