"""Will it fit? Bytes per rank of a training step, planned without allocating the model (private).

:func:`plan` adds up what one rank holds at its peak: the model state of each rank as the
strategy's engine lays it out, the activations autograd saves for backward, the largest
transient buffer of the engine, and the communication per step. Everything that depends on
the engine is asked of its adapter (:func:`fsdp_guide.engines.engine_for`); nothing here
branches on a strategy's name. The activations are not a formula: the model's real forward
runs on fake tensors (:class:`torch._subclasses.fake_tensor.FakeTensorMode`), which have
shapes, dtypes and storages but no data, and :func:`fsdp_guide.wrap.saved_activation_bytes`
counts what autograd keeps, each storage once, as it does on real tensors. So a 70B-parameter
model is planned in seconds on a laptop.

The model state is that of each rank, to the byte (:meth:`fsdp_guide.engines.Engine.layout`):
whole tensors give uneven optimizer shards, flat parameters and FSDP2's row chunks are padded,
Adam keeps a step per tensor.

The activations are those of the CPU kernels that fake tensors dispatch to (CPU flash
attention for ``scaled_dot_product_attention``); CUDA kernels may save other tensors.
Buffers, the CUDA caching allocator's fragmentation and the framework's own workspace come
on top. Inputs count as storages of their own, as a data loader gives them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from torch import nn

from fsdp_guide.comm import CommPrediction, predict_communication
from fsdp_guide.engines import (
    ModelShape,
    StepSizes,
    Transient,
    UnitPolicy,
    UnitRule,
    follows_units,
    model_shape,
    module_calls,
    unit_names,
    unit_summary,
)
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._accumulation import gradient_payload, plan_accumulation
from fsdp_guide.memory._dimensions import RankModel, rank_model
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._pp import combine, stage_requests
from fsdp_guide.memory._predict import state_per_rank
from fsdp_guide.memory._request import PlanRequest, resolve
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._trace import (
    BatchBuilder,
    Checkpointing,
    ModelSource,
    traced_activation_bytes,
)
from fsdp_guide.memory._trainable import TrainableRule, with_frozen
from fsdp_guide.memory._zero import OptimizerName, Precision


def unit_params(model: nn.Module, policy: UnitRule | UnitPolicy = "blocks") -> tuple[int, int]:
    """(largest unit, root unit) parameters of ``model`` cut into units by ``policy``.

    ``"blocks"`` is how FSDP is wrapped for large models, and how the catalog's FSDP
    strategies wrap: a unit per transformer block (:func:`fsdp_guide.engines.block_classes`);
    the root unit holds every parameter outside the blocks (embeddings, final norm, head).

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> unit_params(model), unit_params(model, "root")
        ((17472, 17472), (42880, 42880))
    """
    return _unit_sizes(model_shape(model, policy))


def _unit_sizes(shape: ModelShape) -> tuple[int, int]:
    sizes = [sum(math.prod(s) for s in unit) for unit in shape.units]
    return max(sizes), sizes[0]


def plan(
    model_or_builder: ModelSource,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int,
    strategy: str,
    precision: Precision = "fp32",
    activation_checkpointing: Checkpointing = None,
    cpu_offload: bool = False,
    batch: BatchBuilder | None = None,
    optimizer: OptimizerName = "adam",
    activations: int | None = None,
    policy: UnitRule | UnitPolicy = "blocks",
    tensor_parallel: int = 1,
    tp_plan: Mapping[str, str] | None = None,
    settings: Mapping[str, Any] | None = None,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
    microbatches: int | None = None,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
    context_parallel: int = 1,
    cp_layout: str = "zigzag",
    expert_parallel: int = 1,
    expert_routing: Sequence[Sequence[Any]] | None = None,
    grad_accumulation: int = 1,
    sync_each_micro_step: bool = False,
    trainable: TrainableRule | None = None,
) -> Plan:
    """Plan the bytes one rank holds in a training step, without allocating the model.

    Args:
        model_or_builder: A model, or a function that builds one; a function is called under
            ``torch.device("meta")``, so even 70B parameters take no memory.
        batch_size: Samples per rank.
        seq_len: Tokens per sample.
        world_size: Ranks.
        strategy: Any name of :data:`fsdp_guide.catalog.STRATEGIES`.
        precision: ``"fp32"`` or ``"mixed"`` (bf16 compute, fp32 master weights).
        activation_checkpointing: ``None``, ``"blocks"`` (each ``Block``) or a layer class.
        cpu_offload: Keep the model state in CPU memory (fully sharded strategies only).
        batch: Builds ``(inputs, targets)`` of a batch; known for the demo models.
        optimizer: ``"adam"``, ``"sgd"`` or ``"sgd_momentum"``.
        activations: Bytes already traced by ``traced_activation_bytes`` for this model,
            batch, precision and checkpointing: the trace is skipped (planning one model
            for many strategies traces it once).
        policy: How a fully sharded strategy cuts the model into units: ``"blocks"`` (a
            unit per transformer block: the classes of transformers' ``_no_split_modules``,
            else the repeated children of a ``ModuleList``; what the catalog's FSDP
            strategies do), ``"root"`` (the whole model one unit) or a
            :class:`fsdp_guide.wrap.WrapPolicy`. It decides FSDP1's padding, the largest
            gathered unit and what is gathered twice; :attr:`Plan.units` says the cut.
        tensor_parallel: Ranks per tensor-parallel group, ``t``: the ranks form a
            ``(world_size // t, t)`` mesh, tensor parallelism cuts the layers of ``tp_plan``
            over its second dimension and the strategy (``"fsdp2"`` only) shards over the
            first. ``batch_size`` is then per data-parallel group.
        settings: Engine settings that replace the strategy's own, such as
            ``{"reshard_after_forward": False}`` for ``"fsdp2"`` or
            ``{"backward_prefetch": None}`` for ``"fsdp"`` (the fields of its
            :mod:`fsdp_guide.engines` adapter).
        tp_plan: Layer name (or ``fnmatch`` pattern) to ``"colwise"`` or ``"rowwise"``; by
            default the model's own ``tp_plan`` attribute (:data:`fsdp_guide.parallel.TP_PLAN`
            for :class:`fsdp_guide.parallel.ParallelTransformer`).
        sequence_parallel: With ``tensor_parallel > 1``, plan the layout of
            ``fsdp_guide.parallel.parallelize(..., sequence_parallel=True)``: the norms, the
            residual stream and the blocks' inputs cut along the sequence (``seq_len / t``
            tokens per rank). The state is unchanged (no parameter is cut further); the
            activations outside the tensor-parallel regions shrink by ``t``; the forward
            all-reduce of each rowwise layer becomes a reduce-scatter, each cut module's input
            and the head's input are all-gathered, backward mirrors them, and the norms'
            replicated weights have their gradients all-reduced over ``tp``.
        pipeline_parallel: Pipeline ranks, ``p``: the ranks form a ``(p, dp, tp)`` mesh and
            the model, an ``nn.Sequential`` of layers (or a model whose ``pipeline_layers()``
            returns one), is cut into ``p · v`` contiguous stages (equal numbers of layers,
            the larger stages last), each rank holding its schedule's. ``batch_size`` is then
            the batch of one pipeline (per data-parallel group), split into micro-batches.
            Planned in fp32 with ``"fsdp2"`` over the data-parallel ranks (run, as torchtitan
            does, with ``reshard_after_forward=False``), or ``"ddp"``/``"fsdp2"`` when there
            is one data-parallel rank (no engine then). :attr:`Plan.pipeline` holds the
            stages, the schedule and each pipeline rank's plan.
        microbatches: Micro-batches per step, ``m`` (default ``p``); must divide
            ``batch_size``.
        schedule: ``"GPipe"``, ``"1F1B"`` (default), ``"Interleaved1F1B"``,
            ``"InterleavedZeroBubble"`` or ``"ZBVZeroBubble"``, torch's schedules
            (:func:`fsdp_guide.memory.pipeline_schedule`). The activations are the schedule's
            peak: the micro-batches in flight on the rank's stages after the forward that
            holds the most. With a split backward (the zero-bubble schedules) a micro-batch
            counts until its weights' gradient; the input's half frees part of it earlier, so
            there the figure is an upper bound.
        stages_per_rank: Stages each pipeline rank holds, ``v``: 1 for GPipe and 1F1B, 2 by
            default for the others.
        context_parallel: Ranks per context-parallel group, ``c``: each computes
            ``seq_len / c`` tokens of every sample and its attention is a ring
            (:func:`fsdp_guide.parallel.ring_attention`). The groups are taken from the
            data-parallel ranks, which the strategy still shards over (the ranks of a group
            hold the same weights); ``batch_size`` is then per context-parallel group. Adds
            the ring's ``send`` and ``recv`` per step.
        cp_layout: How the sequence is cut over a context-parallel group: ``"zigzag"``
            (chunks ``r`` and ``2c - 1 - r`` of ``2c``, balanced causal work) or ``"naive"``.
        expert_parallel: Ranks per expert-parallel group, ``e``, within the data-parallel
            ranks (``"fsdp2"`` only): each keeps ``E / e`` experts of every
            mixture-of-experts layer, laid out over the ``dp / e`` ranks holding the same
            ones, while the dense layers are sharded over all ``dp``; adds the all-to-alls
            that route the tokens. Needs ``activations=`` (what a rank's experts compute
            depends on the routing).
        expert_routing: Tokens each rank of an expert-parallel group sends each expert,
            ``[rank][expert]`` for every mixture-of-experts layer alike, or
            ``[layer][rank][expert]``; ``None`` plans a balanced router
            (each rank receives as many token copies as it sends). With a routing,
            :attr:`Plan.all_to_all` gives each rank's payload and the communication is the
            busiest rank's.
        grad_accumulation: Micro-steps (forward and backward) per optimizer step, ``k``:
            :attr:`Plan.accumulation` says what each rank holds between them and sends over
            the ``k`` (``"ddp"``, ``"fsdp"`` and ``"fsdp2"`` engines).
        sync_each_micro_step: With ``k > 1``, ``False`` (the default) reduces the gradients
            once, after the last micro-step: DDP's and FSDP1's ``no_sync()``, FSDP2's
            ``set_requires_gradient_sync(False)`` on the others, where FSDP keeps every
            unsharded gradient in between; ``True`` reduces (reduce-scatters) after each,
            holding gradient shards only.
        trainable: Which parameters train: parameter-name patterns (``fnmatch``, such as
            ``["*lora_*"]``) or a function of the name; ``None`` (the default) keeps the
            model's own ``requires_grad`` (a ``peft`` model freezes its base). Frozen
            parameters have no gradient, no optimizer state and no reduction; planned for
            ``"ddp"`` and ``"fsdp2"``.

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: Unknown strategy, bad sizes, more than ``MAX_RANKS`` (2**20) ranks, a failing
            builder, CPU offload with a strategy that does not shard parameters; a
            tensor-parallel degree that does not divide the ranks or the cut layers, with a
            strategy other than ``"fsdp2"``, or without a plan; ``sequence_parallel``
            without tensor parallelism or with a ``seq_len`` that does not divide by it; a
            world that is not ``pp x dp x tp`` ranks, more stages than layers, micro-batches
            that do not divide the batch, or a pipeline with what it is not planned with;
            a bad ``grad_accumulation``, or an engine whose accumulation is not planned;
            a ``trainable`` that matches nothing, or frozen parameters under another engine
            than DDP and FSDP2; units that split a tied parameter (``fully_shard`` refuses
            them too); accumulation or frozen parameters with pipeline, context or expert
            parallelism (not planned together).

    Examples:
        >>> from fsdp_guide.memory import predict_model_state
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> cfg = TransformerConfig(n_layers=2, dim=32, n_heads=2)
        >>> p = plan(lambda: TinyTransformer(cfg), batch_size=4, seq_len=32, world_size=2,
        ...          strategy="fsdp2")
        >>> extra = p.state.total - predict_model_state("fsdp2", p.num_params, 2).total
        >>> extra == 4 * len(list(TinyTransformer(cfg).parameters()))  # Adam's step per tensor
        True
        >>> copies = plan(lambda: TinyTransformer(cfg), batch_size=4, seq_len=32, world_size=2,
        ...               strategy="ddp", settings={"gradient_as_bucket_view": False})
        >>> kept = copies.between_steps[0]  # DDP's buckets stay, the gradients go
        >>> kept.buckets == copies.state.grads, kept.grads
        (True, 0)
        >>> plan(lambda: TinyTransformer(cfg), batch_size=4, seq_len=32, world_size=2,
        ...      strategy="zero4")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: unknown strategy 'zero4'; choose from ddp, zero1, oss, ...
    """
    request = resolve(
        model_or_builder,
        batch_size=batch_size,
        seq_len=seq_len,
        world_size=world_size,
        strategy=strategy,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        batch=batch,
        optimizer=optimizer,
        activations=activations,
        policy=policy,
        tensor_parallel=tensor_parallel,
        tp_plan=tp_plan,
        settings=settings,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=pipeline_parallel,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        context_parallel=context_parallel,
        cp_layout=cp_layout,
        expert_parallel=expert_parallel,
        expert_routing=expert_routing,
        grad_accumulation=grad_accumulation,
        sync_each_micro_step=sync_each_micro_step,
        trainable=trainable,
    )
    if request.pipeline_parallel > 1:
        return _pipeline(request)
    return _plan_request(request)[0]


def _plan_request(request: PlanRequest) -> tuple[Plan, RankModel]:
    """The plan of one request, and the model its rank computes."""
    rank = rank_model(request)
    shape, units = _units(request, rank)
    ranks, exact = _model_state(request, shape, rank)
    saved = _activations(request, rank)
    communication = _communication(request, rank, shape)
    sizes = _step_sizes(request, rank, shape, saved)
    accumulation = plan_accumulation(request, rank, ranks, communication)
    assembled = _assemble(request, units, ranks, exact, sizes, communication, rank.all_to_all)
    plan = replace(
        assembled,
        trainable_params=request.trainable_params,
        frozen_params=request.frozen_params,
        accumulation=accumulation,
    )
    return plan, rank


def _pipeline(request: PlanRequest) -> Plan:
    """A plan per pipeline rank (its stages, their engine), combined into one."""
    subs = [_plan_request(r) for r in stage_requests(request)]
    return combine(request, [p for p, _ in subs], [r.model for _, r in subs])


def _units(request: PlanRequest, rank: RankModel) -> tuple[ModelShape, str]:
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


def _model_state(
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
        states = [_add(s, by_group[(r // tp) // e]) for r, s in enumerate(states)]
        exact = exact and exact_experts
    return tuple(states), exact


def _add(a: ModelState, b: ModelState) -> ModelState:
    """Two states held together, field by field."""
    return ModelState(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a) if f.init}
    )


def _activations(request: PlanRequest, rank: RankModel) -> int:
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


def _communication(request: PlanRequest, rank: RankModel, shape: ModelShape) -> CommPrediction:
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


def _step_sizes(
    request: PlanRequest, rank: RankModel, shape: ModelShape, activations: int
) -> StepSizes:
    """The sizes the engine's step peak reads, in bytes."""
    per = request.per_param
    largest, root = _unit_sizes(shape)
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


def _assemble(
    request: PlanRequest,
    units: str,
    ranks: tuple[ModelState, ...],
    exact: bool,
    sizes: StepSizes,
    communication: CommPrediction,
    all_to_all: tuple[int, ...] = (),
) -> Plan:
    """The :class:`Plan`: the fullest rank's state, what it keeps between steps, the engine's
    transient buffer and step peak."""
    engine, dp = request.engine, request.data_parallel
    num_params = sum(p.numel() for p in request.model.parameters())
    local_params = sizes.params // request.per_param.params
    largest = sizes.largest_unit // request.per_param.params
    per = request.per_param
    transient = engine.transient(
        param_bytes=per.params, grad_bytes=per.grads, num_params=local_params, largest_unit=largest
    )
    gathered = engine.gathered(sizes, dp)
    if gathered is not None:  # what the engine gathers, known from the modules' order
        transient = Transient(bytes=gathered.peak, kind=gathered.kind)
    state = max(ranks, key=lambda s: s.total)  # the first of the fullest
    between = tuple(
        replace(
            r,
            grads=r.grads if engine.grads_between_steps else 0,
            buckets=r.buckets if engine.buckets_between_steps else 0,
        )
        for r in ranks
    )
    kept = between[ranks.index(state)].total
    peak = engine.step_peak(sizes, dp)
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
        step_peak=(0 if request.cpu_offload else kept) + peak.bytes,
        step_peak_phase=peak.phase,
        step_peak_kind=peak.kind,
        tensor_parallel=request.tensor_parallel,
        units=units,
        sequence_parallel=request.sequence_parallel,
        kept_params=0 if gathered is None else gathered.after_forward,
        context_parallel=request.context_parallel,
        expert_parallel=request.expert_parallel,
        all_to_all=all_to_all,
    )
