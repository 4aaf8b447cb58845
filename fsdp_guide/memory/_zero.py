"""The ZeRO formulas: bytes of model state per rank for each sharding stage.

ZeRO (Rajbhandari et al., 2020) counts, for a model of ``Ψ`` parameters trained on ``N``
data-parallel ranks, ``P`` bytes per parameter, ``G`` per gradient and ``K`` of optimizer
state per parameter:

======= ==================== ==================================== ==========================
stage   what is sharded      bytes per rank                       FairScale / PyTorch
======= ==================== ==================================== ==========================
0       nothing              ``(P + G + K) Ψ``                    DDP
1       optimizer state      ``(P + G) Ψ + K Ψ / N``              OSS, ZeroRedundancyOptimizer
2       + gradients          ``P Ψ + (G + K) Ψ / N``              OSS + ShardedDDP
3       + parameters         ``(P + G + K) Ψ / N``                FSDP (FairScale, FSDP1, FSDP2)
======= ==================== ==================================== ==========================

The formulas ignore what implementations add or round: FSDP pads each flat parameter to a
multiple of ``N``; OSS and ZeroRedundancyOptimizer give whole tensors to ranks, so shards
are only nearly equal; Adam keeps a 4-byte step counter per tensor. For the demo models
those differences stay well under 1%.

DeepSpeed lays the same stages out differently (full parameters beside an fp32 master
partition at stages 1-2, a permanent gradient buffer and a reduce bucket at stage 3, no
gradients after ``engine.step()``): :func:`~fsdp_guide.memory.estimate_deepspeed_state`
is that variant, exact to the byte.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from fsdp_guide.catalog import resolve_stage
from fsdp_guide.launcher import check_world_size
from fsdp_guide.memory._state import ModelState

Precision = Literal["fp32", "mixed"]
OptimizerName = Literal["adam", "adamw", "sgd", "sgd_momentum"]

# Optimizer bytes per parameter (K). Mixed precision adds the fp32 master weights (4 bytes).
# AdamW keeps Adam's two moments: its decoupled weight decay adds no state.
_OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of each kind of state (``P``, ``G`` and ``K`` in ZeRO's notation).

    Examples:
        >>> bytes_per_param("mixed", "adam")
        BytesPerParam(params=2, grads=2, optimizer=12)
    """

    params: int
    grads: int
    optimizer: int


def bytes_per_param(
    precision: Precision = "fp32", optimizer: OptimizerName = "adam"
) -> BytesPerParam:
    """The precision and optimizer presets.

    ``"fp32"``: 4-byte parameters and gradients; Adam keeps two fp32 moments (K = 8), SGD
    with momentum one buffer (K = 4), plain SGD nothing. ``"mixed"``: 16-bit parameters and
    gradients (2 bytes each) and an fp32 master copy of the weights on top of the fp32
    optimizer state, so Adam has K = 12 (ZeRO's 16 bytes per parameter in all).

    Args:
        precision: ``"fp32"`` or ``"mixed"``.
        optimizer: ``"adam"``, ``"adamw"`` (the same bytes as Adam), ``"sgd"`` or
            ``"sgd_momentum"``.

    Raises:
        ValueError: For an unknown precision or optimizer.

    Examples:
        >>> bytes_per_param("fp32", "adam")
        BytesPerParam(params=4, grads=4, optimizer=8)
        >>> bytes_per_param("mixed", "sgd")
        BytesPerParam(params=2, grads=2, optimizer=4)
    """
    if precision not in ("fp32", "mixed"):
        raise ValueError(f"unknown precision {precision!r}; choose 'fp32' or 'mixed'")
    if optimizer not in _OPTIMIZER_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose 'adam', 'adamw', 'sgd' or 'sgd_momentum'"
        )
    k = _OPTIMIZER_BYTES[optimizer]
    if precision == "mixed":
        return BytesPerParam(params=2, grads=2, optimizer=k + 4)
    return BytesPerParam(params=4, grads=4, optimizer=k)


def estimate_model_state(
    num_params: float,
    world_size: int,
    stage: int | str,
    precision: Precision = "fp32",
    optimizer: OptimizerName = "adam",
    *,
    full_grads: bool = False,
) -> ModelState:
    """Bytes of model state per rank that the ZeRO formulas predict.

    Sharded parts are ``ceil(bytes / world_size)``: the largest shard.

    Args:
        num_params: Parameters in the model (``Ψ``).
        world_size: Ranks the state is sharded over (``N``); for hybrid sharding, the size
            of the shard group.
        stage: ZeRO stage: 0 to 3, ``"zero0"`` to ``"zero3"``, or any strategy name of
            :data:`fsdp_guide.catalog.STRATEGIES`.
        precision: ``"fp32"`` (4-byte parameters and gradients) or ``"mixed"`` (2-byte ones
            and an fp32 master copy beside the fp32 optimizer state: ZeRO's 16 bytes per
            parameter with Adam).
        optimizer: ``"adam"``, ``"adamw"`` (the same bytes as Adam), ``"sgd"`` or
            ``"sgd_momentum"``.
        full_grads: Count the whole gradient on every rank whatever the stage. This is what
            FairScale's ShardedDDP holds after the step when its reduce buckets
            (``reduce_buffer_size``, 2**23 elements by default) cover the model: a bucket
            stays allocated after it is reduced, so every rank keeps a full-size gradient
            buffer even though only the owner's shard is summed.

    Returns:
        The predicted ``ModelState``.

    Raises:
        ValueError: For ``num_params`` not positive and finite, ``world_size < 1``, or a
            bad stage, precision or optimizer.

    Examples:
        The ZeRO paper's Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12):

        >>> [round(estimate_model_state(7.5e9, 64, s, "mixed").total / 1e9, 1) for s in range(4)]
        [120.0, 31.4, 16.6, 1.9]
        >>> estimate_model_state(1000, 4, "oss")
        ModelState(params=4000, grads=4000, optimizer=2000, total=10000)
        >>> estimate_model_state(1000, 4, "sharded_ddp", full_grads=True).grads
        4000
    """
    if (
        isinstance(num_params, bool)
        or not isinstance(num_params, int | float)
        or not 0 < num_params < math.inf  # also refuses NaN
    ):
        raise ValueError(f"num_params must be a positive finite number, got {num_params!r}")
    check_world_size(world_size)
    level = resolve_stage(stage)
    per = bytes_per_param(precision, optimizer)

    def part(bytes_each: int, sharded: bool) -> int:
        total = round(bytes_each * num_params)
        return math.ceil(total / world_size) if sharded else total

    return ModelState(
        params=part(per.params, level >= 3),
        grads=part(per.grads, level >= 2 and not full_grads),
        optimizer=part(per.optimizer, level >= 1),
    )


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``"80GB"``, ``"80 GiB"``, ``"1.5T"`` or ``"8e10"``.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000; ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024.

    Raises:
        ValueError: For text that is not a size.

    Examples:
        >>> parse_size("80GB"), parse_size("1 GiB"), parse_size("2.5e3")
        (80000000000, 1073741824, 2500)
        >>> parse_size("lots")
        Traceback (most recent call last):
        ...
        ValueError: cannot read 'lots' as a size; write e.g. 80GB, 40GiB or 8e10
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GB, 40GiB or 8e10")
    number, prefix, binary = match.groups()
    if binary and not prefix:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GB, 40GiB or 8e10")
    base = 1024 if binary else 1000
    value = float(number) * float(base) ** _POWERS[prefix.lower()]
    if not math.isfinite(value):  # e.g. 1e400
        raise ValueError(f"size {text!r} is too large; write e.g. 80GB, 40GiB or 8e10")
    return round(value)


def format_bytes(num_bytes: float, unit: str = "auto") -> str:
    """Bytes as text in decimal units (``"3.45 MB"``), or in a fixed ``unit``.

    Raises:
        ValueError: For a unit other than B, KB, MB, GB, TB or ``"auto"``.

    Examples:
        >>> format_bytes(3_451_904), format_bytes(1.875e9, "GB"), format_bytes(512)
        ('3.45 MB', '1.88 GB', '512 B')
    """
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    if unit == "auto":
        unit = "B"
        for name, scale in units.items():
            if abs(num_bytes) >= scale:
                unit = name
    if unit not in units:
        raise ValueError(f"unknown unit {unit!r}; choose one of {', '.join(units)} or 'auto'")
    if unit == "B":
        return f"{round(num_bytes)} B"
    return f"{num_bytes / units[unit]:.2f} {unit}"
