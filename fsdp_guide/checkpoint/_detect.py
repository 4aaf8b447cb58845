"""Which wrapper holds a model: :func:`detect_strategy`, in the catalog's engine names (private)."""

from __future__ import annotations

import sys
from typing import Literal

import torch
from torch import nn

from fsdp_guide.catalog._table import Engine

#: What :func:`detect_strategy` returns: the *engine* of the catalog's strategies (every FSDP1
#: sharding strategy is ``"fsdp1"``, ``zero1`` is built on ``"zero"``), or ``"module"`` for an
#: unwrapped model. A checkpoint depends on the wrapper, not on how it was configured.
Strategy = Literal["module"] | Engine
# The engines that shard parameters: their checkpoints can be written shard by shard.
SHARDED_STRATEGIES: tuple[Engine, ...] = ("fsdp1", "fsdp2", "fairscale_fsdp", "deepspeed")
# What a DCP checkpoint (PyTorch FSDP shards) loads into, at any world size: whatever
# torch.distributed.checkpoint.state_dict takes a state dict from.
DCP_TARGETS: tuple[str, ...] = ("fsdp1", "fsdp2", "module", "ddp")


def _fairscale_types() -> tuple[type, type, type] | None:
    # A model can only be a FairScale type if FairScale was imported: keep it lazy.
    if "fairscale" not in sys.modules:
        return None
    from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from fairscale.optim import OSS

    return FullyShardedDataParallel, ShardedDataParallel, OSS


def detect_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Strategy:
    """Name the way ``model`` and ``optimizer`` are sharded, from their types.

    Checked in this order: a DeepSpeed engine, FairScale FSDP, PyTorch FSDP2 (``fully_shard``
    on the root), PyTorch FSDP1, FairScale ShardedDDP, then the optimizer (FairScale OSS,
    PyTorch ``ZeroRedundancyOptimizer``), then DDP, else a plain module.

    Args:
        model: The model as it is trained (wrapped or not).
        optimizer: Its optimizer, if any; OSS and ``ZeroRedundancyOptimizer`` are told
            apart from DDP by it.

    Returns:
        ``"module"`` or the catalog engine name (``"ddp"``, ``"zero"``, ``"oss"``,
        ``"sharded_ddp"``, ``"fsdp1"``, ``"fsdp2"``, ``"fairscale_fsdp"``, ``"deepspeed"``).

    Raises:
        TypeError: ``model`` is not a module, or FSDP1/FSDP2 is applied to sub-modules
            only (wrap the root too: state dicts are taken from the root).

    Examples:
        >>> detect_strategy(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters()))
        'module'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.nn.parallel import DistributedDataParallel

    from fsdp_guide.deepspeed._engine import is_engine

    if is_engine(model):
        return "deepspeed"
    fairscale = _fairscale_types()
    if fairscale is not None and isinstance(model, fairscale[0]):
        return "fairscale_fsdp"
    if isinstance(model, FSDPModule):
        return "fsdp2"
    if isinstance(model, FSDP1):
        return "fsdp1"
    if any(isinstance(m, FSDPModule | FSDP1) for m in model.modules()):
        raise TypeError(
            "FSDP is applied to sub-modules but not to the root module; wrap the root as well "
            "(fully_shard(model) or FullyShardedDataParallel(model)) before saving or loading"
        )
    if fairscale is not None and isinstance(model, fairscale[1]):
        return "sharded_ddp"
    if fairscale is not None and isinstance(optimizer, fairscale[2]):
        return "oss"
    # Only an imported class has instances: importing torch.distributed.optim just to ask
    # would script its functional optimizers (66 torch.jit deprecation warnings per process).
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return "zero"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "module"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP or ShardedDDP wrapper (``model.module``), else ``model``.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> unwrap(layer) is layer
        True
    """
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and not _is_torch_fsdp(model) else model


def _is_torch_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return isinstance(model, FSDPModule | FSDP1)
