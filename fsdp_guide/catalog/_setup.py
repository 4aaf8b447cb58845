"""How each strategy wraps a model and builds its Adam optimizer, inside a launched rank (private).

Each ``setup_*`` function is named by one entry of the strategy table
(:data:`fsdp_guide.catalog.STRATEGIES`): a new strategy is one entry and, when it wraps
differently from every existing one, one function here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

#: What a setup returns: the module to train and its optimizer. A DeepSpeed engine's
#: optimizer is DeepSpeed's ZeRO optimizer, typed as the torch optimizer it wraps; step it
#: through :func:`fsdp_guide.deepspeed.backward_and_step`, which asks the engine.
Wrapped = tuple[nn.Module, torch.optim.Optimizer]


@dataclass(frozen=True)
class SetupContext:
    """What a setup function needs besides the model.

    Attributes:
        device: Where this rank's model lives (its GPU under NCCL, else the CPU).
        world_size: Number of ranks.
        lr: Adam's learning rate.
    """

    device: torch.device
    world_size: int
    lr: float


def _adam(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    # Bucket views: the gradients live in DDP's buckets, so there is one copy to count.
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def _largest_first(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sorted largest first, for OSS.

    OSS gives each tensor, in the order it receives them, to the rank with the fewest
    elements so far. In model order that leaves the demo transformer's shards up to 7% apart
    at 4 ranks; largest first (what ZeroRedundancyOptimizer does itself) evens them out.
    """
    return sorted(model.parameters(), key=lambda p: p.numel(), reverse=True)


def _sharded_ddp(model: nn.Module, lr: float, buffer: int) -> Wrapped:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    optimizer = OSS(_largest_first(model), optim=torch.optim.Adam, lr=lr)
    return ShardedDataParallel(model, optimizer, reduce_buffer_size=buffer), optimizer


def _fsdp1(model: nn.Module, device: torch.device, strategy: str, world_size: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    kwargs: dict[str, Any] = {}
    if strategy.startswith("HYBRID") or strategy.startswith("_HYBRID"):
        from torch.distributed.device_mesh import init_device_mesh

        shard = 2 if world_size % 2 == 0 else world_size
        # A 2-D mesh (replicate, shard): no GPU-count guessing, so it runs on gloo too.
        kwargs["device_mesh"] = init_device_mesh(
            device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    return FullyShardedDataParallel(
        model, device_id=device, sharding_strategy=ShardingStrategy[strategy], **kwargs
    )


def _fsdp2(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in getattr(model, "blocks", []):  # one shard group per transformer block
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fairscale_fsdp(model: nn.Module) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel

    wrapped: nn.Module = FullyShardedDataParallel(model, mixed_precision=False)
    return wrapped


def _with_adam(module: nn.Module, lr: float) -> Wrapped:
    return module, _adam(module.parameters(), lr)


def _zero1(module: nn.Module, lr: float) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(
        module.parameters(), optimizer_class=torch.optim.Adam, lr=lr
    )
    return module, optimizer


def _oss(model: nn.Module, device: torch.device, lr: float) -> Wrapped:
    from fairscale.optim import OSS

    # OSS first: it turns each rank's parameters into views of one flat buffer.
    optimizer = OSS(_largest_first(model), optim=torch.optim.Adam, lr=lr)
    return _ddp(model, device), optimizer


def setup_ddp(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_ddp(model, ctx.device), ctx.lr)


def setup_zero1(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _zero1(_ddp(model, ctx.device), ctx.lr)


def setup_oss(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _oss(model, ctx.device, ctx.lr)


def setup_sharded_ddp(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _sharded_ddp(model, ctx.lr, buffer=0)


def setup_sharded_ddp_buckets(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _sharded_ddp(model, ctx.lr, buffer=2**23)


def setup_fsdp(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fsdp1(model, ctx.device, "FULL_SHARD", ctx.world_size), ctx.lr)


def setup_fsdp_grad_op(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fsdp1(model, ctx.device, "SHARD_GRAD_OP", ctx.world_size), ctx.lr)


def setup_fsdp_no_shard(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fsdp1(model, ctx.device, "NO_SHARD", ctx.world_size), ctx.lr)


def setup_fsdp_hybrid(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fsdp1(model, ctx.device, "HYBRID_SHARD", ctx.world_size), ctx.lr)


def setup_fsdp2(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fsdp2(model, ctx.device, ctx.world_size), ctx.lr)


def setup_fairscale_fsdp(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _with_adam(_fairscale_fsdp(model), ctx.lr)


def _deepspeed(
    model: nn.Module,
    ctx: SetupContext,
    stage: int,
    *,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> Wrapped:
    from fsdp_guide.deepspeed._config import zero_config
    from fsdp_guide.deepspeed._engine import initialize

    config = zero_config(
        stage, lr=ctx.lr, offload_optimizer=offload_optimizer, offload_params=offload_params
    )
    engine, optimizer = initialize(model, config)
    return engine, cast(torch.optim.Optimizer, optimizer)


def setup_deepspeed_zero1(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _deepspeed(model, ctx, 1)


def setup_deepspeed_zero2(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _deepspeed(model, ctx, 2)


def setup_deepspeed_zero2_offload(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _deepspeed(model, ctx, 2, offload_optimizer=True)


def setup_deepspeed_zero3(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _deepspeed(model, ctx, 3)


def setup_deepspeed_zero3_offload(model: nn.Module, ctx: SetupContext) -> Wrapped:
    return _deepspeed(model, ctx, 3, offload_optimizer=True, offload_params=True)
