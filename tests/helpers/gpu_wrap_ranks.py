"""The CUDA rank function of ``tests/gpu/test_wrap_fairscale_gpu.py``, importable by spawned ranks.

:func:`run_fairscale` shards the TinyTransformer with FairScale's FSDP in each configuration
(policies, manual wrapping, checkpointed Blocks) and trains it beside the unwrapped model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide.models import (
    Block,
    TinyTransformer,
    TransformerConfig,
    loss_fn,
    shard_batch,
    synthetic_batch,
)
from fsdp_guide.wrap import (
    LayerPolicy,
    SizePolicy,
    WrapPolicy,
    check_optimizer,
    checkpoint_layers,
    describe,
    shard,
    sharded_units,
    wrap,
    wrapping,
)

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)
STEPS = 5
GLOBAL_BATCH = 4
POLICIES: dict[str, WrapPolicy] = {
    "size": SizePolicy(min_num_params=2_000),
    "layer": LayerPolicy(Block),
    "union": LayerPolicy(nn.Embedding) | SizePolicy(min_num_params=10_000),
}
# Blocks checkpointed by FairScale's wrapper, and by PyTorch's (which shard() replaces by
# FairScale's inside each unit: PyTorch's around a FairScale unit fails in backward).
CONFIGURATIONS = [*POLICIES, "manual", "layer+checkpoint", "layer+torch-checkpoint"]


def build() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def train(model: nn.Module, rank: int, world_size: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    check_optimizer(model, optimizer)
    losses = []
    for step in range(STEPS):
        batch = synthetic_batch("transformer", GLOBAL_BATCH, step=step, config=CONFIG)
        tokens, targets = shard_batch(batch, rank, world_size)
        loss = loss_fn(model, (tokens.cuda(), targets.cuda()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def sharded_model(name: str) -> nn.Module:
    model = build().cuda()
    if name == "manual":
        with wrapping(engine="fairscale_fsdp"):
            model.blocks[1] = wrap(model.blocks[1])
            model.head = wrap(model.head)
            return wrap(model)
    if name.endswith("checkpoint"):
        implementation = "torch" if name == "layer+torch-checkpoint" else "fairscale"
        checkpoint_layers(model, Block, implementation=implementation)
        return shard(model, engine="fairscale_fsdp", policy=POLICIES["layer"])
    return shard(model, engine="fairscale_fsdp", policy=POLICIES[name])


def run_fairscale(rank: int, world_size: int) -> dict[str, Any]:
    reference = train(build().cuda(), rank=0, world_size=1)  # whole batch, one process
    results: dict[str, Any] = {"reference": reference}
    for name in CONFIGURATIONS:
        model = sharded_model(name)
        results[name] = {
            "units": sharded_units(model),
            "description": describe(model),
            "losses": train(model, rank, world_size),
        }
    return results
