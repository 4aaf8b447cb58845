"""The one vocabulary of sharding strategies: a table every part of the package reads.

Each strategy has one name, used by ``python -m fsdp_guide compare --strategies``,
:func:`fsdp_guide.compare.run_comparison`, :func:`fsdp_guide.checkpoint.detect_strategy` and
the ZeRO formulas (:func:`fsdp_guide.memory.estimate_model_state` takes any strategy name as
its stage). Its :class:`StrategySpec` says which ZeRO stage it is, which engine it is built on,
what it needs (CUDA, FairScale, DeepSpeed), which formula predicts the state it holds, and how
it wraps a model and builds its optimizer. Adding a strategy is adding one entry to
:data:`STRATEGIES`.

=========================== ===== ============== =================================================
name                        stage engine         what it is
=========================== ===== ============== =================================================
``ddp``                     0     ddp            PyTorch DDP
``zero1`` (``zero``)        1     zero           DDP + ``ZeroRedundancyOptimizer``
``oss``                     1     oss            DDP + FairScale OSS
``sharded_ddp``             2     sharded_ddp    FairScale OSS + ShardedDDP, no reduce buckets
``sharded_ddp_buckets``     2     sharded_ddp    the same with its default reduce buckets
``fsdp`` (``fsdp1``)        3     fsdp1          PyTorch FSDP1, ``FULL_SHARD``
``fsdp_grad_op``            2     fsdp1          PyTorch FSDP1, ``SHARD_GRAD_OP``
``fsdp_no_shard``           0     fsdp1          PyTorch FSDP1, ``NO_SHARD``
``fsdp_hybrid``             3     fsdp1          PyTorch FSDP1, ``HYBRID_SHARD`` in pairs
``fsdp2``                   3     fsdp2          PyTorch FSDP2, ``fully_shard`` per block
``fairscale_fsdp``          3     fairscale_fsdp FairScale FSDP (CUDA only)
``deepspeed_zero1``         1     deepspeed      DeepSpeed ZeRO-1 (the ``deepspeed`` extra)
``deepspeed_zero2``         2     deepspeed      DeepSpeed ZeRO-2
``deepspeed_zero2_offload`` 2     deepspeed      DeepSpeed ZeRO-2, optimizer on the CPU
``deepspeed_zero3``         3     deepspeed      DeepSpeed ZeRO-3
``deepspeed_zero3_offload`` 3     deepspeed      DeepSpeed ZeRO-3, optimizer and parameters on CPU
=========================== ===== ============== =================================================

Stages are accepted everywhere as ``0``-``3``, ``"zero0"``-``"zero3"`` or any name above
(:func:`resolve_stage`).

Examples:
    >>> from fsdp_guide.catalog import get_strategy
    >>> spec = get_strategy("fsdp1")
    >>> spec.name, spec.engine, spec.zero_stage, sorted(spec.needs)
    ('fsdp', 'fsdp1', 3, [])
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_guide.catalog._setup import SetupContext, Wrapped
from fsdp_guide.catalog._table import (
    DEFAULT_STRATEGIES,
    STRATEGIES,
    Engine,
    Requirement,
    StrategySpec,
    check_strategies,
    get_strategy,
    resolve_stage,
)
from fsdp_guide.launcher import rank_device

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGIES",
    "Engine",
    "Requirement",
    "SetupContext",
    "StrategySpec",
    "check_strategies",
    "cpu_strategies",
    "get_strategy",
    "resolve_stage",
    "wrap_for_strategy",
]


def wrap_for_strategy(
    model: nn.Module, strategy: str, world_size: int, lr: float = 1e-3
) -> Wrapped:
    """Wrap ``model`` for ``strategy`` and build its Adam optimizer, inside a launched rank.

    The process group must be up (:func:`fsdp_guide.launch` does that). On NCCL the model
    moves to this rank's GPU; on gloo it stays on CPU.

    Args:
        model: The model, identical on every rank.
        strategy: A name (or alias) from :data:`STRATEGIES`.
        world_size: Number of ranks.
        lr: Adam's learning rate.

    Returns:
        The module to train and its optimizer.

    Raises:
        ValueError: For an unknown strategy, or a CUDA-only one without CUDA.

    Examples:
        >>> wrap_for_strategy(nn.Linear(2, 2), "zero4", 1)
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero4'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    (spec,) = check_strategies([strategy])
    device = torch.device("cuda", torch.cuda.current_device()) if spec.needs_cuda else rank_device()
    context = SetupContext(device=device, world_size=world_size, lr=lr)
    return spec.setup(model.to(device), context)


def cpu_strategies(*, deepspeed: bool = True) -> list[str]:
    """The catalog's names that run on CPU ranks under gloo, in catalog order.

    Args:
        deepspeed: Include the DeepSpeed stages (they need the ``deepspeed`` extra, and an
            engine steps through ``engine.backward``/``engine.step``).

    Examples:
        >>> "fairscale_fsdp" in cpu_strategies()  # FairScale's FSDP needs CUDA
        False
        >>> [n for n in cpu_strategies(deepspeed=False) if n.startswith("deepspeed")]
        []
    """
    return [
        name
        for name, spec in STRATEGIES.items()
        if not spec.needs_cuda and (deepspeed or spec.engine != "deepspeed")
    ]
