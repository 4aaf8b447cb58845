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
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from torch import nn

from fsdp_guide.catalog import get_strategy
from fsdp_guide.comm import predict_communication
from fsdp_guide.engines import (
    ModelShape,
    StepSizes,
    Transient,
    UnitPolicy,
    UnitRule,
    engine_for,
    follows_units,
    model_shape,
    module_calls,
    unit_names,
    unit_summary,
)
from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import check_world_size
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._predict import state_per_rank
from fsdp_guide.memory._tp import (
    check_sp,
    check_tp,
    cut_layers,
    local_model,
    sequence_parallel_model,
    sp_elements,
    tp_all_reduce_elements,
    tp_plan_of,
)
from fsdp_guide.memory._trace import (
    BatchBuilder,
    Checkpointing,
    ModelSource,
    build_on_meta,
    check_sizes,
    traced_activation_bytes,
)
from fsdp_guide.memory._zero import (
    OptimizerName,
    Precision,
    bytes_per_param,
)

#: The most ranks :func:`plan` takes: it keeps a model state per rank.
MAX_RANKS = 2**20


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
        activations: Bytes already traced by :func:`traced_activation_bytes` for this model,
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

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: Unknown strategy, bad sizes, more than ``MAX_RANKS`` (2**20) ranks, a failing
            builder, CPU offload with a strategy that does not shard parameters; a
            tensor-parallel degree that does not divide the ranks or the cut layers, with a
            strategy other than ``"fsdp2"``, or without a plan; ``sequence_parallel``
            without tensor parallelism or with a ``seq_len`` that does not divide by it.

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
    try:
        spec = get_strategy(strategy)
        engine = engine_for(spec)
        if settings:
            known = sorted(f.name for f in fields(engine))
            unknown = sorted(set(settings) - set(known))
            if unknown:
                raise PlanError(
                    f"{spec.name!r} runs on {engine.name}, which has no setting {unknown}; "
                    f"its settings: {', '.join(known) or 'none'}"
                )
            engine = replace(engine, **settings)
        check_world_size(world_size)
        # Under autocast (DDP and the optimizers over it) the bf16 copies are the forward's
        # own: parameters, gradients and DDP's buckets stay fp32, and so do their all-reduces.
        autocast = precision == "mixed" and engine.mixed_precision == "autocast"
        per = bytes_per_param("fp32" if autocast else precision, optimizer)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    if world_size > MAX_RANKS:  # a state per rank is kept: bound what that costs
        raise PlanError(
            f"world_size {world_size:,} is above the {MAX_RANKS:,} ranks plan() handles"
        )
    check_sizes(batch_size, seq_len)
    if cpu_offload and engine.stage_at_step < 3:
        raise PlanError(
            f"cpu_offload needs a fully sharded strategy (fsdp, fsdp2, ...), not {spec.name!r}"
        )
    model = build_on_meta(model_or_builder)
    num_params = sum(p.numel() for p in model.parameters())
    if num_params == 0:
        raise PlanError(f"{type(model).__name__} has no parameters to train")
    tp = check_tp(engine, world_size, tensor_parallel)
    sp = check_sp(sequence_parallel, tp, seq_len)
    tp_payload: dict[str, int] = {}
    if tp > 1:  # from here on, the model is what one rank of a tensor-parallel group computes
        cut = cut_layers(model, tp, tp_plan_of(model, tp_plan))
        if sp:
            tp_payload = sp_elements(model, cut, batch_size, seq_len)
            model = sequence_parallel_model(local_model(model, tp, cut), tp, cut)
        else:
            tp_payload = {"all_reduce": tp_all_reduce_elements(model, cut, batch_size, seq_len)}
            model = local_model(model, tp, cut)
    dp = world_size // tp
    try:
        names = unit_names(model, policy)
        shape = model_shape(model, policy)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    local_params = shape.num_params
    dp_ranks, exact = state_per_rank(engine, shape, dp, precision, optimizer)
    ranks = tuple(dp_ranks[r // tp] for r in range(world_size))  # the mesh is row-major
    state = max(ranks, key=lambda s: s.total)  # the first of the fullest
    if activations is not None:
        if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
            raise PlanError(f"activations must be an int >= 0 bytes, got {activations!r}")
    else:
        activations = traced_activation_bytes(
            model,
            batch_size,
            seq_len,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            batch=batch,
            mixed="params" if engine.mixed_precision == "params" else "autocast",
        )
    largest, root = _unit_sizes(shape)
    transient = engine.transient(
        param_bytes=per.params, grad_bytes=per.grads, num_params=local_params, largest_unit=largest
    )
    dtype = "bf16" if precision == "mixed" and not autocast else "fp32"
    communication = predict_communication(spec.name, local_params, dp, dtype, shape=shape)
    if tp > 1:
        # FSDP2's collectives over dp, tensor (and sequence) parallelism's over tp, by kind.
        payload = dict(communication.payload)
        for kind, elements in tp_payload.items():
            payload[kind] = payload.get(kind, 0) + elements
        communication = replace(
            communication,
            num_params=num_params,
            world_size=world_size,
            payload=payload,
            group_sizes={**communication.group_sizes, "all_reduce": tp},
        )
    sizes = StepSizes(
        params=per.params * local_params,
        grads=per.grads * local_params,
        largest_unit=per.params * largest,
        largest_unit_grads=per.grads * largest,
        root_unit=per.params * root,
        activations=activations,
        calls=module_calls(model),
        blocks=len(shape.units) - 1,
    )
    peak = engine.step_peak(sizes, dp)
    gathered = engine.gathered(sizes, dp)
    if gathered is not None:  # what the engine gathers, known from the modules' order
        transient = Transient(bytes=gathered.peak, kind=gathered.kind)
    between = tuple(
        replace(
            r,
            grads=r.grads if engine.grads_between_steps else 0,
            buckets=r.buckets if engine.buckets_between_steps else 0,
        )
        for r in ranks
    )
    kept = between[ranks.index(state)].total
    return Plan(
        strategy=spec.name,
        world_size=world_size,
        num_params=num_params,
        precision=precision,
        state=state,
        activations=activations,
        transient=transient.bytes,
        transient_kind=transient.kind,
        communication=communication,
        cpu_offload=cpu_offload,
        ranks=ranks,
        exact_state=exact,
        between_steps=between,
        step_peak=(0 if cpu_offload else kept) + peak.bytes,
        step_peak_phase=peak.phase,
        step_peak_kind=peak.kind,
        tensor_parallel=tp,
        units=unit_summary(model, names, policy) if follows_units(engine) else "",
        sequence_parallel=sp,
        kept_params=0 if gathered is None else gathered.after_forward,
    )
