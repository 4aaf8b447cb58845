"""The wrapping configurations the CPU and CUDA wrap tests shard the TinyTransformer with.

``tests/wrap/test_wrap_sharded.py`` runs them under FSDP1 and FSDP2 on gloo,
``tests/gpu/test_wrap_fairscale_gpu.py`` under FairScale's FSDP on NCCL (its ranks are spawned,
so everything here must be importable).
"""

from __future__ import annotations

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
    shard,
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


def build() -> nn.Module:
    """The seeded TinyTransformer of :data:`CONFIG`, on the CPU."""
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def train(
    model: nn.Module, rank: int, world_size: int, device: torch.device | None = None
) -> list[float]:
    """SGD with momentum on this rank's slice of the seeded batches; the mean loss per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    check_optimizer(model, optimizer)
    losses = []
    for step in range(STEPS):
        batch = synthetic_batch("transformer", GLOBAL_BATCH, step=step, config=CONFIG)
        loss = loss_fn(model, shard_batch(batch, rank, world_size, device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def shard_configuration(name: str, engine: str, device: torch.device | None = None) -> nn.Module:
    """:func:`build` sharded by ``engine`` as configuration ``name`` says.

    ``name`` is a key of :data:`POLICIES`, ``"manual"`` (``blocks.1`` and ``head`` wrapped by
    hand), ``"layer+checkpoint"`` (each Block checkpointed, the default implementation but
    FairScale's own under FairScale's FSDP) or ``"layer+torch-checkpoint"`` (PyTorch's
    wrapper, which ``shard()`` replaces under FairScale's FSDP).
    """
    model = build().to(device or "cpu")
    if name == "manual":
        with wrapping(engine=engine):  # type: ignore[arg-type]
            model.blocks[1] = wrap(model.blocks[1])
            model.head = wrap(model.head)
            return wrap(model)
    if name.endswith("checkpoint"):
        fairscale = engine == "fairscale_fsdp" and name == "layer+checkpoint"
        checkpoint_layers(model, Block, implementation="fairscale" if fairscale else "torch")
        return shard(model, engine=engine, policy=POLICIES["layer"])  # type: ignore[arg-type]
    return shard(model, engine=engine, policy=POLICIES[name])  # type: ignore[arg-type]
