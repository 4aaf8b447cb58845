"""Model state per rank to the byte, from parameter shapes and the strategy's engine (private).

The ZeRO formulas (:func:`~fsdp_guide.memory.estimate_model_state`) split ``Ψ`` evenly. The
engines do not, and each engine's adapter says what every rank of it holds, in elements
(:meth:`fsdp_guide.engines.Engine.layout`): whole tensors give uneven optimizer shards, flat
parameters and FSDP2's row chunks are padded, DeepSpeed keeps a master copy. Here those
elements become bytes at a precision and optimizer.
An engine that does not know its layout for a setting gets the ZeRO formula on every rank,
marked as not exact.

Adam (``torch.optim.Adam``, neither fused nor capturable) adds a 4-byte ``step`` tensor per
tensor it updates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from fsdp_guide.catalog import StrategySpec
from fsdp_guide.engines import Engine, Layout, ModelShape, deepspeed_layout, engine_for
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._zero import (
    BytesPerParam,
    OptimizerName,
    Precision,
    bytes_per_param,
    estimate_model_state,
)

# Adam's step counter: a 0-d fp32 tensor per parameter it updates.
_STEP_BYTES = {"adam": 4, "adamw": 4, "sgd": 0, "sgd_momentum": 0}
# A master copy is fp32 whatever the model's precision.
_MASTER_BYTES = 4


def bytes_of(layout: Layout, per: BytesPerParam, step_bytes: int) -> ModelState:
    """The bytes of a :class:`~fsdp_guide.engines.Layout` at ``per`` bytes per element.

    Buckets hold gradients, so they count at the gradients' size; a master copy and its
    gradient are fp32.

    Examples:
        >>> from fsdp_guide.engines import Layout
        >>> bytes_of(Layout(params=10, grads=10, optimizer=5, steps=1), bytes_per_param(), 4)
        ModelState(params=40, grads=40, optimizer=44, total=124)
    """
    return ModelState(
        params=per.params * layout.params,
        grads=per.grads * layout.grads + _MASTER_BYTES * layout.master_grads,
        optimizer=per.optimizer * layout.optimizer + step_bytes * layout.steps,
        buckets=per.grads * layout.buckets,
        master=_MASTER_BYTES * layout.master,
    )


def _engine(strategy: str | StrategySpec | Engine) -> Engine:
    return strategy if isinstance(strategy, Engine) else engine_for(strategy)


def predict_model_state(
    strategy: str | StrategySpec,
    num_params: int,
    world_size: int,
    param_numels: Sequence[int] | None = None,
) -> ModelState:
    """The fp32 Adam prediction for what a rank of ``strategy`` holds after ``optimizer.step()``.

    The ZeRO formula (:func:`estimate_model_state`) for the stage and shard group the
    strategy's engine holds at that point, except where the engine has a formula of its own:
    DeepSpeed (a separate fp32 master copy, padded partitions, ZeRO-3's gradient buffer and
    reduce bucket; :func:`estimate_deepspeed_state` with the buckets of
    :func:`~fsdp_guide.deepspeed.zero_config`).

    Args:
        strategy: A name of :data:`fsdp_guide.catalog.STRATEGIES`, or its spec.
        num_params: Parameters of the model.
        world_size: Number of ranks.
        param_numels: The size of each parameter tensor; DeepSpeed's ZeRO-3 pads each
            one to a multiple of ``world_size`` (none or empty: one tensor of ``num_params``).

    Raises:
        ValueError: For an unknown strategy or bad sizes.

    Examples:
        >>> predict_model_state("oss", 1000, 2)
        ModelState(params=4000, grads=4000, optimizer=4000, total=12000)
        >>> predict_model_state("fsdp_grad_op", 1000, 2)  # resharded after backward: stage 3
        ModelState(params=2000, grads=2000, optimizer=4000, total=8000)
        >>> predict_model_state("deepspeed_zero2", 1000, 2)
        ModelState(params=4000, master=2000, grads=0, optimizer=4004, total=10004)
    """
    engine = _engine(strategy)
    own = engine.own_formula(list(param_numels) if param_numels else [num_params], world_size)
    if own is not None:
        return bytes_of(own, bytes_per_param("fp32", "adam"), _STEP_BYTES["adam"])
    return estimate_model_state(
        num_params,
        engine.shard_group_size(world_size),
        engine.stage_at_step,
        "fp32",
        "adam",
        full_grads=engine.full_grads,
    )


def state_per_rank(
    strategy: str | StrategySpec | Engine,
    shapes: Sequence[Sequence[int]] | ModelShape,
    world_size: int,
    precision: Precision = "fp32",
    optimizer: OptimizerName = "adam",
) -> tuple[tuple[ModelState, ...], bool]:
    """The model state each rank holds after ``optimizer.step()``, and whether it is exact.

    Args:
        strategy: A strategy's name or spec, or an engine.
        shapes: The shape of each parameter, in ``model.parameters()`` order, or the
            model's units (:func:`fsdp_guide.engines.model_shape`): FSDP1 pads a flat
            parameter per unit.
        world_size: Ranks.
        precision: ``"fp32"`` or ``"mixed"``. torch's and FairScale's mixed precision
            compute on bf16 copies and keep the state in fp32: ``"mixed"`` is the fp32
            state there. DeepSpeed keeps bf16 parameters and gradients, and an fp32 master
            copy counted apart (:meth:`fsdp_guide.engines.Engine.mixed_layout`, with
            Adam); with another optimizer it gets ZeRO's byte counts.
        optimizer: ``"adam"``, ``"sgd"`` or ``"sgd_momentum"``.

    Returns:
        One ``ModelState`` per rank, and ``True`` when the
        engine's layout is known (else each rank gets the ZeRO formula).

    Examples:
        Two tensors of 10 and 7 elements (17 in all) on 2 ranks, fp32 Adam:

        >>> states, exact = state_per_rank("zero1", [(10,), (7,)], 2)
        >>> [s.optimizer for s in states], exact  # 8 bytes per element + a 4-byte step each
        ([84, 60], True)
        >>> [s.params for s in state_per_rank("fsdp", [(10,), (7,)], 2)[0]]
        [36, 36]
        >>> [s.optimizer for s in state_per_rank("fsdp2", [(10,), (7,)], 2)[0]]
        [80, 72]

        torch's mixed precision (FSDP2's ``MixedPrecisionPolicy`` here) keeps the fp32 state:

        >>> fp32, _ = state_per_rank("fsdp2", [(10,), (7,)], 2)
        >>> state_per_rank("fsdp2", [(10,), (7,)], 2, "mixed")[0] == fp32
        True

        DeepSpeed ZeRO-2 in bf16: 2-byte parameters, the master copy apart from Adam's moments:

        >>> state_per_rank("deepspeed_zero2", [(10,), (7,)], 2, "mixed")[0][0]
        ModelState(params=40, master=40, grads=0, optimizer=84, total=164)
    """
    engine = _engine(strategy)
    layouts, per, step = _layouts(engine, shapes, world_size, precision, optimizer)
    if layouts is not None:
        distinct: dict[Layout, ModelState] = {}  # a million ranks share a handful of layouts
        for one in layouts:
            if one not in distinct:
                distinct[one] = bytes_of(one, per, step)
        return tuple(distinct[one] for one in layouts), True
    plain = shapes.shapes if isinstance(shapes, ModelShape) else shapes
    total = sum(math.prod(shape) for shape in plain)
    formula = estimate_model_state(
        total,
        engine.shard_group_size(world_size),
        engine.stage_at_step,
        precision,
        optimizer,
        full_grads=engine.full_grads,
    )
    return (formula,) * world_size, False


def host_per_rank(
    strategy: str | StrategySpec | Engine,
    shapes: Sequence[Sequence[int]] | ModelShape,
    world_size: int,
    precision: Precision = "fp32",
    optimizer: OptimizerName = "adam",
) -> tuple[ModelState, ...]:
    """What of :func:`state_per_rank` each rank keeps in host memory: what the engine offloads
    (:meth:`fsdp_guide.engines.Engine.host_layout`), none where its layout is not known.

    Examples:
        >>> [s.total for s in host_per_rank("deepspeed_zero3_offload", [(10,), (7,)], 2)]
        [220, 220]
        >>> host_per_rank("fsdp2", [(10,), (7,)], 2)[0].total
        0
    """
    engine = _engine(strategy)
    layouts, per, step = _layouts(engine, shapes, world_size, precision, optimizer)
    if layouts is None:
        return (ModelState(0, 0, 0),) * world_size
    return tuple(bytes_of(engine.host_layout(one), per, step) for one in layouts)


def _layouts(
    engine: Engine,
    shapes: Sequence[Sequence[int]] | ModelShape,
    world_size: int,
    precision: Precision,
    optimizer: OptimizerName,
) -> tuple[tuple[Layout, ...] | None, BytesPerParam, int]:
    """Each rank's layout (``None`` where not known), and the bytes per element it is kept in."""
    if precision == "mixed" and engine.fp32_state_when_mixed:
        # bf16 compute on copies of fp32 state: the state is the fp32 one.
        return _layouts(engine, shapes, world_size, "fp32", optimizer)
    per = bytes_per_param(precision, optimizer)
    step = _STEP_BYTES[optimizer]
    if precision == "mixed" and optimizer in ("adam", "adamw"):
        plain = shapes.shapes if isinstance(shapes, ModelShape) else shapes
        mixed = engine.mixed_layout(plain, world_size)
        if mixed is not None:
            # The master copy has a field of its own: the optimizer keeps the moments only.
            moments = replace(per, optimizer=bytes_per_param("fp32", optimizer).optimizer)
            return mixed, moments, step
    fp32_adam = precision == "fp32" and optimizer in ("adam", "adamw")
    if isinstance(shapes, ModelShape):
        return engine.shape_layout(shapes, world_size, fp32_adam=fp32_adam), per, step
    return engine.layout(shapes, world_size, fp32_adam=fp32_adam), per, step


def estimate_deepspeed_state(
    param_numels: int | Sequence[int],
    world_size: int,
    stage: int,
    *,
    reduce_bucket_size: int = 500_000_000,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> ModelState:
    """Bytes per rank that a DeepSpeed engine holds after ``engine.step()``: the ZeRO
    formulas in DeepSpeed's own layout (fp32 model, torch Adam, one parameter group).

    With ``Ψ`` parameters, ``N`` ranks, ``Ψ₁ ... Ψₜ`` the sizes of the ``t`` parameter
    tensors and ``B`` the ``reduce_bucket_size`` (elements), in bytes:

    ========= ============ ============ ============ ========== ============
    stage     params       master       grads        buckets    optimizer
    ========= ============ ============ ============ ========== ============
    0         ``4Ψ``       0            0            0          ``8Ψ + 4t``
    1, 2      ``4Ψ'``      ``4Ψ'/N``    0            0          ``8Ψ'/N + 4``
    3         ``4S``       ``4S``       ``4S``       ``4B``     ``8S + 4``
    ========= ============ ============ ============ ========== ============

    ``Ψ' = ceil(Ψ / 2N) · 2N`` (ZeRO-1/2 pad their flat buffer to a multiple of twice the
    ranks) and ``S = Σ ceil(Ψᵢ / N)`` (ZeRO-3 pads each tensor to a multiple of ``N``). What
    differs from :func:`~fsdp_guide.memory.estimate_model_state`:

    * ZeRO-1/2 keep every parameter in full (``4Ψ``) *and* an fp32 master copy of this
      rank's partition, reported as ``master``, even for an fp32 model; ZeRO-3 keeps a
      parameter shard and a master shard.
    * ``engine.step()`` clears the gradients: ZeRO-0/1/2 hold none afterwards (they hold
      gradients between ``engine.backward()`` and the step, which this does not predict).
      ZeRO-3 keeps a buffer of its gradient partitions for the whole run, and its reduce
      bucket of ``B`` elements (``contiguous_gradients``, on by default) as ``buckets``.
    * Adam steps one flat partition per rank, so it has one 4-byte step tensor (ZeRO-0:
      one per tensor).

    Offload (``offload_optimizer``, ``offload_param`` with device ``"cpu"``) moves the
    master copy, the optimizer state and the gradient partitions (and, for
    ``offload_param``, ZeRO-3's parameter shards) to CPU memory; on a CPU run they stay in
    the process, and the offloaded optimizer adds buffers of its own: ZeRO-1/2 a partition
    of parameters waiting to be gathered (``+4Ψ'/N`` params), the master copy's gradient
    (``+4Ψ'/N`` grads) and two staging buffers the size of the largest tensor
    (``+8 max Ψᵢ`` buckets); ZeRO-3 the master copy's gradient (``+4S`` grads).
    ``offload_param`` changes no byte count.

    Assumed, as in the tests: ``stage3_param_persistence_threshold`` 0 (every tensor is
    sharded; the default of 1e5 elements keeps small tensors whole) and fewer parameters
    than ``sub_group_size`` (one ZeRO-3 sub-group). Scalars (the last gradient norm, an
    overflow flag) are not counted.

    Args:
        param_numels: The size of each parameter tensor, e.g.
            ``[p.numel() for p in model.parameters()]``; an int is one tensor of that size.
        world_size: Data-parallel ranks (``N``).
        stage: ZeRO stage, 0 to 3.
        reduce_bucket_size: ``zero_optimization.reduce_bucket_size`` in elements.
        offload_optimizer: ``zero_optimization.offload_optimizer`` is set (stages 1-3).
        offload_param: ``zero_optimization.offload_param`` is set (stage 3).

    Returns:
        The predicted ``ModelState``, measured by
        :func:`~fsdp_guide.memory.measure_model_state` on the engine.

    Raises:
        ValueError: For bad sizes, world size or stage, or an offload the stage lacks.

    Examples:
        Two tensors of 1000 and 10 elements on 4 ranks, a bucket of 100 elements. ZeRO-2 pads
        1010 elements to 1016 (a multiple of 8), ZeRO-3 each tensor to a multiple of 4:

        >>> estimate_deepspeed_state([1000, 10], 4, 2, reduce_bucket_size=100)
        ModelState(params=4064, master=1016, grads=0, optimizer=2036, total=7116)
        >>> estimate_deepspeed_state([1000, 10], 4, 3, reduce_bucket_size=100)
        ModelState(params=1012, master=1012, grads=1012, optimizer=2028, buckets=400, total=5464)
        >>> estimate_deepspeed_state(1010, 4, 0).total  # 12 bytes per parameter and a step
        12124
    """
    layout = deepspeed_layout(
        param_numels,
        world_size,
        stage,
        reduce_bucket_size=reduce_bucket_size,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
    )
    return bytes_of(layout, bytes_per_param("fp32", "adam"), _STEP_BYTES["adam"])
