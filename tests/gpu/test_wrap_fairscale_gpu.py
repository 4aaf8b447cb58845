"""FairScale's FullyShardedDataParallel through shard(), wrapping() and checkpoint_layers (CUDA).

FairScale's FSDP runs only on CUDA, so these tests carry the ``gpu`` marker and skip on
CPU machines. They run on as many GPUs as are visible, up to 2, with NCCL (one GPU: world
size 1). The parent process never touches CUDA, so ranks can be forked; each rank also
trains the unwrapped model on the whole global batch as the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide import launch
from fsdp_guide.models import (
    Block,
    TinyTransformer,
    TransformerConfig,
    count_params,
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

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)
STEPS = 5
GLOBAL_BATCH = 4
POLICIES: dict[str, WrapPolicy] = {
    "size": SizePolicy(min_num_params=2_000),
    "layer": LayerPolicy(Block),
    "union": LayerPolicy(nn.Embedding) | SizePolicy(min_num_params=10_000),
}
CONFIGURATIONS = [*POLICIES, "manual", "layer+checkpoint"]


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
    if name == "layer+checkpoint":
        checkpoint_layers(model, Block, implementation="fairscale")
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


@pytest.fixture(scope="module")
def fairscale_results() -> list[dict[str, Any]]:
    world_size = min(2, torch.cuda.device_count())
    return launch(run_fairscale, world_size, backend="nccl", start_method="fork", timeout=600)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_fairscale_losses_match_unwrapped_model(
    fairscale_results: list[dict[str, Any]], name: str
) -> None:
    for rank_result in fairscale_results:
        reference = rank_result["reference"]
        torch.testing.assert_close(rank_result[name]["losses"], reference, rtol=1e-5, atol=0)
        assert reference[-1] < reference[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_fairscale_units_are_exactly_those_selected(
    fairscale_results: list[dict[str, Any]], name: str
) -> None:
    units = fairscale_results[0][name]["units"]
    expected = {
        "manual": {"blocks.1", "head"},
        "layer+checkpoint": set(POLICIES["layer"].select(build())),
    }.get(name) or set(POLICIES[name].select(build()))
    assert set(units) == {""} | expected
    assert {kind for kind, _ in units.values()} == {"fairscale_fsdp"}
    assert sum(n for _, n in units.values()) == count_params(build())
    if name in POLICIES:
        planned = sharded_units(build(), policy=POLICIES[name])
        assert {k: n for k, (_, n) in units.items()} == {k: n for k, (_, n) in planned.items()}
    description = fairscale_results[0][name]["description"]
    assert description.count("[unit: fairscale_fsdp,") == len(units)
    if name == "layer+checkpoint":
        assert description.count("[checkpointed]") == CONFIG.n_layers
