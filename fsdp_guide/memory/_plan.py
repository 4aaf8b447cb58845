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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from fsdp_guide.engines import UnitPolicy, UnitRule, model_shape
from fsdp_guide.memory import _plan_steps as steps
from fsdp_guide.memory._accumulation import plan_accumulation
from fsdp_guide.memory._dimensions import RankModel, rank_model
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._plan_steps import unit_sizes
from fsdp_guide.memory._pp import combine, stage_requests
from fsdp_guide.memory._request import PlanRequest, resolve
from fsdp_guide.memory._trace import BatchBuilder, Checkpointing, ModelSource
from fsdp_guide.memory._trainable import TrainableRule
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
    return unit_sizes(model_shape(model, policy))


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
    foreach: bool | None = None,
    gpus_per_node: int | None = None,
    reduce_dtype: str | None = None,
    pipeline_parallel: int = 1,
    microbatches: int | None = None,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
    context_parallel: int = 1,
    cp_layout: str = "zigzag",
    expert_parallel: int = 1,
    expert_routing: Sequence[Sequence[Any]] | None = None,
    grad_accumulation: int = 1,
    sync_each_micro_step: bool | None = None,
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
        optimizer: ``"adam"``, ``"adamw"`` (planned as Adam: AdamW's decoupled weight
            decay keeps no state of its own), ``"sgd"`` or ``"sgd_momentum"``.
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
        foreach: How the optimizer steps: ``True`` every tensor at once, which allocates a
            temporary as large as the tensors it steps; ``False`` (torch's default on CPU)
            one tensor at a time, two temporaries of the largest. ``None`` (the default)
            plans what torch's Adam picks on CUDA: every tensor at once for plain and
            DTensor parameters, one at a time for the ``FlatParameter`` objects FSDP1 and
            FairScale FSDP step (torch takes its foreach path for those types only).
        gpus_per_node: GPUs of a node. HSDP (``"fsdp2_hybrid"``, ``"fsdp_hybrid"``) then
            shards within a node and replicates across nodes (without it, in the row's
            groups of 2); the communication says which collectives cross nodes.
        reduce_dtype: What the gradients are reduced in under ``precision="mixed"``:
            ``"fp32"`` (the default, as the guide's FSDP2 scripts set
            ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, for every engine alike) or
            ``"bf16"`` (DeepSpeed's own default, its ``communication_data_type``, and FSDP's
            when ``reduce_dtype`` is not set). Autocast's gradients are fp32 whatever is asked.
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
        grad_accumulation: Micro-steps (forward and backward) of ``batch_size`` per optimizer
            step, ``k``: :attr:`Plan.communication` is then the optimizer step's (``k``
            micro-steps, the reductions as ``sync_each_micro_step`` says), the step peak
            counts the gradients held from one micro-step to the next, and
            :attr:`Plan.accumulation` says what each rank holds between micro-steps and
            sends over the ``k``, kind by kind.
        sync_each_micro_step: With ``k > 1``, when the gradients are reduced. ``None`` (the
            default) is the engine's own way: DDP's ``no_sync()`` and DeepSpeed ZeRO-1 once
            per optimizer step; FSDP, FSDP2 and DeepSpeed ZeRO-2/3 after every micro-step,
            holding gradient shards only. ``False`` reduces once, after the last micro-step
            (FSDP1's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)`` on the
            others), where FSDP keeps every unsharded gradient in between; ``True`` after
            each. Either is planned for the ``"ddp"``, ``"fsdp"`` and ``"fsdp2"`` engines;
            the others plan their own way only.
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
            a bad ``grad_accumulation``, or a ``sync_each_micro_step`` the engine does not
            offer;
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
        foreach=foreach,
        gpus_per_node=gpus_per_node,
        reduce_dtype=reduce_dtype,
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
    shape, units = steps.units(request, rank)
    ranks, hosts, exact = steps.model_state(request, shape, rank)
    profile = steps.activations(request, rank)
    micro_step = steps.communication(request, rank, shape)
    sizes = steps.step_sizes(request, rank, shape, profile, ranks)
    # One micro-step's collectives become the optimizer step's: k micro-steps, the
    # gradients' reductions held back to the last or not.
    accumulation = plan_accumulation(request, rank, ranks, micro_step)
    communication = micro_step
    held = None
    if accumulation is not None:
        communication = replace(micro_step, payload=dict(accumulation.payload))
        held = accumulation.held
    assembled = steps.assemble(
        request, units, ranks, hosts, exact, sizes, communication, rank.all_to_all, held
    )
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
