"""What :func:`fsdp_guide.memory.plan` is asked, resolved once: :class:`PlanRequest` (private).

``torch.distributed.checkpoint.state_dict`` checks its options and resolves them into one
record before it walks a model; the planner does the same. :func:`resolve` checks every
keyword of ``plan()``, builds the model on the meta device, looks up the strategy's engine
with its settings, and fills in what the keywords leave to the strategy; the steps of the
plan then read this record only, and raise nothing about the caller's input.

Adding a dimension of parallelism (pipeline, context, expert) is a field here, checked in
:func:`resolve`, and a cut of the model in ``_dimensions.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

from fsdp_guide.catalog import get_strategy
from fsdp_guide.engines import Engine, UnitPolicy, UnitRule, engine_for
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._accumulation import check_accumulation
from fsdp_guide.memory._cp import check_context_parallel
from fsdp_guide.memory._ep import check_expert_parallel
from fsdp_guide.memory._pp_checks import check_pipeline
from fsdp_guide.memory._trace import BatchBuilder, Checkpointing, build_on_meta, check_sizes
from fsdp_guide.memory._trainable import TrainableRule, apply_trainable, check_frozen, check_tied
from fsdp_guide.memory._zero import BytesPerParam, OptimizerName, Precision, bytes_per_param

#: The most ranks :func:`plan` takes: it keeps a model state per rank.
MAX_RANKS = 2**20


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One plan's question, checked and with every default filled in.

    Attributes:
        source: The model or builder as the caller gave it.
        model: The whole model, on the meta device.
        strategy: The strategy's catalog name.
        engine: Its engine, with the strategy's settings and those the caller gave.
        batch_size: Samples per rank (per data-parallel group with tensor parallelism).
        seq_len: Tokens per sample.
        world_size: Ranks.
        precision: ``"fp32"`` or ``"mixed"``.
        optimizer: ``"adam"``, ``"sgd"`` or ``"sgd_momentum"`` (``"adamw"`` is planned as
            ``"adam"``: the same state and the same step).
        checkpointing: What activation checkpointing checkpoints, or ``None``.
        batch: Builds the example batch, or ``None`` for the model's own.
        activations: Bytes saved for backward given by the caller, or ``None`` to trace them.
        policy: How a fully sharded strategy cuts the model into units.
        cpu_offload: Whether the model state lives in host memory.
        tensor_parallel: Ranks per tensor-parallel group (1: none).
        tp_plan: Layer name (or pattern) to style, or ``None`` for the model's own.
        sequence_parallel: Whether the sequence is cut over the tensor-parallel ranks too.
        foreach: Whether the optimizer steps every tensor at once; resolved from ``None`` to
            torch's own choice on CUDA (every tensor at once, unless the engine steps flat
            parameters).
        gpus_per_node: GPUs of a node (``None``: not given); HSDP shards within a node.
        reduce_dtype: What the gradients' collectives carry: ``"fp32"`` or ``"bf16"``.
        pipeline_parallel: Pipeline ranks (1: none); the mesh is ``(pp, dp, tp)``.
        microbatches: Micro-batches per step of the pipeline.
        schedule: The pipeline schedule, torch's name (``"1F1B"``).
        stages_per_rank: Pipeline stages each pipeline rank holds.
        pipeline_rank: The pipeline rank whose stages are planned.
        context_parallel: Ranks per context-parallel group (1: none), within the
            data-parallel ranks.
        cp_layout: How the sequence is cut over them: ``"naive"`` or ``"zigzag"``.
        expert_parallel: Ranks per expert-parallel group (1: none), within the
            data-parallel ranks.
        expert_routing: Tokens each rank of an expert-parallel group sends each expert of
            each mixture-of-experts layer, ``[layer][rank][expert]``, or ``None`` for a
            balanced router.
        grad_accumulation: Micro-steps per optimizer step.
        sync_each_micro_step: Whether each micro-step reduces its gradients (resolved: the
            engine's own way when not asked).
        trainable_params: Parameters that train (``requires_grad``).
        frozen_params: Parameters that do not.
    """

    source: Any
    model: nn.Module
    strategy: str
    engine: Engine
    batch_size: int
    seq_len: int
    world_size: int
    precision: Precision
    optimizer: OptimizerName
    checkpointing: Checkpointing
    batch: BatchBuilder | None
    activations: int | None
    policy: UnitRule | UnitPolicy
    cpu_offload: bool
    tensor_parallel: int
    tp_plan: Mapping[str, str] | None
    sequence_parallel: bool
    foreach: bool
    gpus_per_node: int | None = None
    reduce_dtype: str = "fp32"
    pipeline_parallel: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    pipeline_rank: int = 0
    context_parallel: int = 1
    cp_layout: str = "zigzag"
    expert_parallel: int = 1
    expert_routing: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    grad_accumulation: int = 1
    sync_each_micro_step: bool = False
    trainable_params: int = 0
    frozen_params: int = 0

    @property
    def autocast(self) -> bool:
        """Whether bf16 runs under ``torch.autocast`` (DDP and the optimizers over it): the
        parameters, gradients and DDP's buckets stay fp32, and so do their all-reduces."""
        return self.precision == "mixed" and self.engine.mixed_precision == "autocast"

    @property
    def per_param(self) -> BytesPerParam:
        """Bytes per parameter, gradient and optimizer element as the engine keeps them."""
        return bytes_per_param("fp32" if self.autocast else self.precision, self.optimizer)

    @property
    def comm_dtype(self) -> str:
        """What the engine's collectives carry: bf16 where the parameters are cast."""
        return "bf16" if self.precision == "mixed" and not self.autocast else "fp32"

    @property
    def mixed_kind(self) -> str:
        """How the trace runs bf16: on cast parameters, or under autocast."""
        return "params" if self.engine.mixed_precision == "params" else "autocast"

    @property
    def data_parallel(self) -> int:
        """Ranks the strategy shards over: the world, less the tensor- and pipeline-parallel
        groups."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)


def _int_at_least(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _engine(strategy: str, settings: Mapping[str, Any] | None) -> tuple[str, Engine]:
    """The strategy's catalog name and engine, ``settings`` replacing the row's own."""
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
    except ValueError as exc:  # an unknown name, a bad setting's value
        raise PlanError(str(exc)) from exc
    return spec.name, engine


def resolve(
    model_or_builder: Any,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int,
    strategy: str,
    precision: Precision,
    activation_checkpointing: Checkpointing,
    cpu_offload: bool,
    batch: BatchBuilder | None,
    optimizer: OptimizerName,
    activations: int | None,
    policy: UnitRule | UnitPolicy,
    tensor_parallel: int,
    tp_plan: Mapping[str, str] | None,
    settings: Mapping[str, Any] | None,
    sequence_parallel: bool,
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
    expert_routing: Any = None,
    grad_accumulation: int = 1,
    sync_each_micro_step: bool | None = None,
    trainable: TrainableRule | None = None,
) -> PlanRequest:
    """``plan()``'s keywords checked, in the order a caller's mistakes are best named.

    Raises:
        PlanError: For any keyword :func:`fsdp_guide.memory.plan` refuses.

    Examples:
        >>> from fsdp_guide.models import MLP
        >>> request = resolve(MLP(), batch_size=2, seq_len=1, world_size=4, strategy="fsdp2",
        ...     precision="mixed", activation_checkpointing=None, cpu_offload=False, batch=None,
        ...     optimizer="adam", activations=None, policy="blocks", tensor_parallel=2,
        ...     tp_plan=None, settings=None, sequence_parallel=False)
        >>> request.data_parallel, request.comm_dtype, request.per_param.params
        (2, 'bf16', 2)
    """
    name, engine = _engine(strategy, settings)
    _int_at_least("world_size", world_size, 1)
    try:
        bytes_per_param(precision, optimizer)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    if world_size > MAX_RANKS:  # a state per rank is kept: bound what that costs
        raise PlanError(
            f"world_size {world_size:,} is above the {MAX_RANKS:,} ranks plan() handles"
        )
    check_sizes(batch_size, seq_len)
    if cpu_offload and engine.stage_at_step < 3:
        raise PlanError(
            f"cpu_offload needs a fully sharded strategy (fsdp, fsdp2, ...), not {name!r}"
        )
    if activations is not None and (
        isinstance(activations, bool) or not isinstance(activations, int) or activations < 0
    ):
        raise PlanError(f"activations must be an int >= 0 bytes, got {activations!r}")
    k, sync = check_accumulation(
        engine, grad_accumulation, sync_each_micro_step, precision == "mixed"
    )
    model = build_on_meta(model_or_builder)
    if not any(math.prod(p.shape) for p in model.parameters()):
        raise PlanError(f"{type(model).__name__} has no parameters to train")
    trainable_params, frozen_params = apply_trainable(model, trainable)
    check_frozen(engine, frozen_params)
    check_tied(model, policy)
    tp = _check_tensor_parallel(engine, world_size, tensor_parallel)
    _check_sequence_parallel(sequence_parallel, tp, seq_len)
    if foreach is not None and not isinstance(foreach, bool):
        raise PlanError(f"foreach must be True, False or None, got {foreach!r}")
    engine = _on_nodes(engine, world_size // tp, gpus_per_node)
    if optimizer == "adamw":  # Adam's moments and step; the weight decay keeps no state
        optimizer = "adam"
    pipeline = check_pipeline(
        model,
        name=name,
        settings=settings,
        world_size=world_size,
        tensor_parallel=tp,
        batch_size=batch_size,
        precision=precision,
        sequence_parallel=sequence_parallel,
        pipeline_parallel=pipeline_parallel,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
    )
    cp = check_context_parallel(context_parallel, cp_layout, world_size // tp, seq_len)
    if cp > 1 and sequence_parallel:
        raise PlanError("sequence_parallel with context_parallel > 1 is not planned: pick one")
    ep, routing = check_expert_parallel(
        expert_parallel, expert_routing, model, engine, world_size // tp, activations
    )
    if ep > 1 and tp > 1:
        raise PlanError("expert_parallel with tensor_parallel > 1 is not planned: pick one")
    if pipeline.get("pipeline_parallel", 1) > 1 and (cp > 1 or ep > 1):
        raise PlanError(
            "pipeline_parallel with context_parallel or expert_parallel is not planned: pick one"
        )
    if (k > 1 or frozen_params) and (pipeline.get("pipeline_parallel", 1) > 1 or cp > 1 or ep > 1):
        what = "grad_accumulation > 1" if k > 1 else "frozen parameters"
        raise PlanError(
            f"{what} with pipeline, context or expert parallelism is not planned: plan them apart"
        )
    return PlanRequest(
        source=model_or_builder,
        model=model,
        strategy=name,
        engine=engine,
        batch_size=batch_size,
        seq_len=seq_len,
        world_size=world_size,
        precision=precision,
        optimizer=optimizer,
        checkpointing=activation_checkpointing,
        batch=batch,
        activations=activations,
        policy=policy,
        cpu_offload=cpu_offload,
        tensor_parallel=tp,
        tp_plan=tp_plan,
        sequence_parallel=sequence_parallel,
        foreach=(not engine.flat_parameters) if foreach is None else foreach,
        gpus_per_node=gpus_per_node,
        reduce_dtype=_reduce_dtype(engine, precision, reduce_dtype),
        **pipeline,
        context_parallel=cp,
        cp_layout=cp_layout,
        expert_parallel=ep,
        expert_routing=routing,
        grad_accumulation=k,
        sync_each_micro_step=sync,
        trainable_params=trainable_params,
        frozen_params=frozen_params,
    )


def _on_nodes(engine: Engine, data_parallel: int, gpus_per_node: int | None) -> Engine:
    """``engine`` on nodes of ``gpus_per_node``: HSDP (an engine with a ``shard_group``)
    shards within a node and replicates across nodes.

    Raises:
        PlanError: For a node size that is not an int >= 1, or data-parallel ranks that
            fill no whole number of nodes under HSDP.
    """
    if gpus_per_node is None:
        return engine
    _int_at_least("gpus_per_node", gpus_per_node, 1)
    if getattr(engine, "shard_group", None) is None:
        return engine
    shard = min(gpus_per_node, data_parallel)
    if data_parallel % shard:
        raise PlanError(
            f"{data_parallel} data-parallel ranks are not a whole number of nodes of "
            f"{gpus_per_node} GPUs: HSDP shards within a node; give a world size that "
            "divides by gpus_per_node"
        )
    return replace(engine, **{"shard_group": shard})


def _reduce_dtype(engine: Engine, precision: str, reduce_dtype: str | None) -> str:
    """What the gradients' collectives carry: fp32 in fp32 and under autocast (the gradients
    are fp32), else ``reduce_dtype``, fp32 by default for every engine (as the guide's FSDP2
    script sets it; DeepSpeed's own default is bf16, its ``communication_data_type``)."""
    if reduce_dtype not in (None, "fp32", "bf16"):
        raise PlanError(f"reduce_dtype must be 'fp32', 'bf16' or None, got {reduce_dtype!r}")
    if precision != "mixed" or engine.mixed_precision == "autocast":
        return "fp32"
    return reduce_dtype or "fp32"


def _check_tensor_parallel(engine: Engine, world_size: int, tensor_parallel: object) -> int:
    """``tensor_parallel``, checked: an int dividing the ranks, with plain FSDP2 on ``dp``."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        raise PlanError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    tp = tensor_parallel
    if tp < 1 or world_size % tp:
        raise PlanError(f"tensor_parallel={tp} must be >= 1 and divide world_size={world_size}")
    dp = world_size // tp
    # FSDP2 over the whole data-parallel dimension: no all-reduce of its own (HSDP has one).
    hybrid = "all_reduce" in engine.collectives(dp, dp).payload
    if tp > 1 and (engine.name != "fsdp2" or hybrid):
        raise PlanError(
            "tensor parallelism is planned with strategy='fsdp2' on the other mesh "
            f"dimension, not {engine.name!r}"
        )
    return tp


def _check_sequence_parallel(sequence_parallel: object, tp: int, seq_len: int) -> None:
    """``sequence_parallel``, checked: it needs ``tp > 1`` and a sequence that divides by it."""
    if not isinstance(sequence_parallel, bool):
        raise PlanError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if sequence_parallel and tp == 1:
        raise PlanError(
            "sequence_parallel=True cuts the sequence over the tensor-parallel ranks: "
            "pass tensor_parallel > 1 as well"
        )
    if sequence_parallel and seq_len % tp:
        raise PlanError(
            f"seq_len={seq_len} is not divisible by tensor_parallel={tp}: sequence "
            "parallelism gives each rank seq_len / tensor_parallel tokens; choose a seq_len "
            "that divides"
        )
