"""DeepSpeed's ZeRO engines: what they hold after ``engine.step()``, measured and predicted.

DeepSpeed is an optional extra: nothing here imports it. An engine or ZeRO optimizer is
recognised through the classes of a ``deepspeed`` already in :data:`sys.modules` (an object
of DeepSpeed's can only exist once it has been imported).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_guide.launcher._checks import check_world_size
from fsdp_guide.memory._state import ModelState

# DeepSpeed's default ``reduce_bucket_size`` (elements).
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000

# fp32 parameters, gradients, master copy; Adam's two moments; Adam's step tensor.
_FP32 = 4
_ADAM = 8
_STEP = 4

_ZERO_OPTIMIZERS = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
)


def _loaded_class(module_name: str, class_name: str) -> type | None:
    module = sys.modules.get(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_deepspeed_engine(obj: object) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (False when DeepSpeed is not loaded)."""
    engine = _loaded_class("deepspeed.runtime.engine", "DeepSpeedEngine")
    return engine is not None and isinstance(obj, engine)


def zero_stage_of(optimizer: object) -> int | None:
    """``2`` for the ZeRO-1/2 optimizer (one class for both), ``3`` for ZeRO-3, else None."""
    for stage, (module_name, class_name) in zip((2, 3), _ZERO_OPTIMIZERS, strict=True):
        cls = _loaded_class(module_name, class_name)
        if cls is not None and isinstance(optimizer, cls):
            return stage
    return None


def engine_optimizer(engine: nn.Module, optimizer: object) -> Any:
    """The optimizer to measure for ``engine``: its own, whichever of its names was given.

    Raises:
        ValueError: When ``optimizer`` is neither ``None``, ``engine.optimizer`` nor the
            torch optimizer inside it.
    """
    own = getattr(engine, "optimizer", None)
    if optimizer is None or optimizer is own or optimizer is getattr(own, "optimizer", None):
        return own
    raise ValueError(
        "optimizer must be None or the DeepSpeed engine's own optimizer (engine.optimizer), "
        f"got a {type(optimizer).__name__} that the engine does not use"
    )


def _tensors(*groups: Iterable[Any] | None) -> list[Any]:
    return [t for group in groups if group is not None for t in group]


def _optional(*tensors: Any) -> list[Any]:
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _grads(tensors: Iterable[Any]) -> list[Any]:
    return [getattr(t, "grad", None) for t in tensors]


def _state_tensors(optimizer: Any) -> list[Any]:
    return [v for per_param in optimizer.state.values() for v in per_param.values()]


def deepspeed_state_tensors(module: nn.Module, zero: Any) -> dict[str, list[Any]]:
    """The tensors a DeepSpeed ZeRO optimizer holds, by :class:`ModelState` field.

    Lists the storages that the module's parameters and the ZeRO optimizer keep, not
    views of them counted twice (the counter dedups storages anyway). Left out: the
    optimizer's scalar bookkeeping (the last gradient norm, the overflow flag) and the meta
    tensors that only describe shapes.
    """
    params = list(module.parameters())
    inner = zero.optimizer  # the torch optimizer stepping the fp32 partitions
    if zero_stage_of(zero) == 3:
        master = list(zero.fp32_partitioned_groups_flat)
        buckets = getattr(zero, "ipg_buckets", {}) or {}
        return {
            # The shards: ds_tensor, views of one flat buffer; param.data is empty when released.
            "params": _tensors(
                params,
                [getattr(p, "ds_tensor", None) for p in params],
                getattr(zero, "fp16_partitioned_groups_flat", None),
                getattr(zero, "param_groups_fp16_flat_cpu_memory", None),
                _optional(getattr(zero, "lp_param_buffer", None)),
            ),
            "master": master,
            # The gradient partitions' buffer stays allocated for the whole run; the master
            # copy's .grad too when the optimizer is offloaded.
            "grads": _tensors(
                _grads(params),
                _grads(master),
                _optional(getattr(zero, "grad_partitions_flat_buffer", None)),
            ),
            "buckets": [getattr(bucket, "buffer", None) for bucket in buckets.values()],
            "optimizer": _state_tensors(inner),
        }
    master = list(zero.single_partition_of_fp32_groups)
    averaged = getattr(zero, "averaged_gradients", {}) or {}
    return {
        # bit16_groups_flat holds every parameter in full, whatever the dtype (fp32 here);
        # with an offloaded optimizer, a partition-sized copy waits for the all-gather.
        "params": _tensors(
            params,
            zero.bit16_groups_flat,
            getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", None),
        ),
        "master": master,
        "grads": _tensors(
            _grads(params),
            _grads(master),
            [t for grads in averaged.values() if grads is not None for t in grads],
            _optional(getattr(zero, "grads_in_partition", None)),
        ),
        "buckets": _tensors(
            getattr(zero, "ipg_buffer", None),
            _optional(
                getattr(zero, "temp_grad_buffer_for_cpu_offload", None),
                getattr(zero, "temp_grad_buffer_for_gpu_offload", None),
            ),
        ),
        "optimizer": _state_tensors(inner),
    }


def _check_numels(param_numels: int | Sequence[int]) -> list[int]:
    numels = [param_numels] if isinstance(param_numels, int) else list(param_numels)
    if not numels or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numels):
        raise ValueError(
            "param_numels must be a positive int or a non-empty sequence of them (the sizes "
            f"of the parameter tensors), got {param_numels!r}"
        )
    return numels


def estimate_deepspeed_state(
    param_numels: int | Sequence[int],
    world_size: int,
    stage: int,
    *,
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE,
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
        The predicted :class:`~fsdp_guide.memory.ModelState`, measured by
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
    numels = _check_numels(param_numels)
    check_world_size(world_size)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(reduce_bucket_size, bool) or not isinstance(reduce_bucket_size, int):
        raise ValueError(f"reduce_bucket_size must be an int, got {reduce_bucket_size!r}")
    if reduce_bucket_size < 1:
        raise ValueError(f"reduce_bucket_size must be >= 1 element, got {reduce_bucket_size}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")
    total = sum(numels)
    if stage == 0:
        return ModelState(
            params=_FP32 * total, grads=0, optimizer=_ADAM * total + _STEP * len(numels)
        )
    if stage == 3:
        shard = sum(math.ceil(n / world_size) for n in numels)
        return ModelState(
            params=_FP32 * shard,
            master=_FP32 * shard,
            grads=_FP32 * shard * (2 if offload_optimizer else 1),
            buckets=_FP32 * reduce_bucket_size,
            optimizer=_ADAM * shard + _STEP,
        )
    alignment = 2 * world_size  # two 16-bit elements: 4-byte aligned partition starts
    padded = math.ceil(total / alignment) * alignment
    partition = padded // world_size
    offloaded = 1 if offload_optimizer else 0
    return ModelState(
        params=_FP32 * (padded + offloaded * partition),
        master=_FP32 * partition,
        grads=_FP32 * partition * offloaded,
        buckets=2 * _FP32 * max(numels) * offloaded,
        optimizer=_ADAM * partition + _STEP,
    )
