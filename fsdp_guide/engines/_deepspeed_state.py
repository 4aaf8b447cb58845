"""What a DeepSpeed ZeRO optimizer holds, tensor by tensor, for measuring (private).

DeepSpeed is an optional extra: nothing here imports it. An engine or ZeRO optimizer is
recognised through the classes of a ``deepspeed`` already in :data:`sys.modules` (an object
of DeepSpeed's can only exist once it has been imported).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

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
    """The tensors a DeepSpeed ZeRO optimizer holds, by ``ModelState`` field.

    Lists the storages that the module's parameters and the ZeRO optimizer keep, not
    views of them counted twice (the counter dedups storages anyway). Left out: the
    optimizer's scalar bookkeeping (the last gradient norm, the overflow flag) and the meta
    tensors that only describe shapes. The order of the fields settles shared storages.
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
