"""A sharded checkpoint of PyTorch FSDP1 or FSDP2 loads at every world size from 1 to 6.

Layers of odd widths (7, 3 and 2 rows) split unevenly, and from 3 ranks on some ranks hold
nothing of a layer. An FSDP1 optimizer state gives such a rank a ``ShardedTensor`` without
local shards, which DCP's own load planner took for a checkpoint of torch 2.3 and failed on
("Missing key in checkpoint state_dict: optimizer.param_groups"): saved at 1 or 2 ranks, it
loaded at 1 and 2 only.

One launch per saving world size saves both strategies; one launch per loading world size
loads all six checkpoints in turn. Each load must give the model and optimizer state that
was saved, bit for bit (gathered with DCP's own ``get_state_dict``), and the next training
step must match the one the saving run took without stopping (to float32 rounding: the
gradients are averaged over another number of ranks).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict  # imported once, before the ranks fork
import torch.distributed.fsdp
from checkpoint_helpers import differences, snapshot
from torch import nn

from fsdp_guide import checkpoint, launch

STRATEGIES = ("fsdp1", "fsdp2")
SAVED_AT = (1, 2, 3)
LOADED_AT = (1, 2, 3, 4, 5, 6)
WIDTHS = (5, 7, 3, 2)  # Linear(5, 7), Linear(7, 3), Linear(3, 2)
BATCH = 60  # splits evenly over 1 to 6 ranks
STEPS_BEFORE = 2


def build(strategy: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(WIDTHS) - 2 else [])
    model: nn.Module = nn.Sequential(*layers)
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, index: int) -> None:
    """One optimizer step on this rank's rows of global batch ``index``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(index)
    inputs = torch.randn(BATCH, WIDTHS[0], generator=generator)
    targets = torch.randn(BATCH, WIDTHS[-1], generator=generator)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
    optimizer.step()


def save_both(rank: int, world_size: int, root: str) -> Any:
    torch.set_num_threads(1)
    out = {}
    for strategy in STRATEGIES:
        model, optimizer = build(strategy, seed=0)
        for index in range(STEPS_BEFORE):
            step(model, optimizer, index)
        checkpoint.save(f"{root}/{strategy}-{world_size}", model, optimizer, kind="sharded")
        saved = snapshot(model, optimizer, strategy)
        step(model, optimizer, STEPS_BEFORE)  # the run goes on without stopping
        out[strategy] = {"saved": saved, "after": snapshot(model, optimizer, strategy)}
    return out if rank == 0 else None


def load_all(rank: int, world_size: int, root: str) -> Any:
    torch.set_num_threads(1)
    out = {}
    for strategy in STRATEGIES:
        # Built once (wrapping is the slow part): each load then replaces what the previous
        # load and step left, and the checkpoints of the three saving world sizes differ in
        # their last bits, so a load that changed nothing would not pass for one that worked.
        model, optimizer = build(strategy, seed=1)  # other weights, no optimizer state
        for saved_at in SAVED_AT:
            checkpoint.load(f"{root}/{strategy}-{saved_at}", model, optimizer)
            loaded = snapshot(model, optimizer, strategy)
            step(model, optimizer, STEPS_BEFORE)
            out[f"{strategy} saved at {saved_at}"] = {
                "loaded": loaded,
                "after": snapshot(model, optimizer, strategy),
            }
    return out if rank == 0 else None


def tensors(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {path: state}
    if not isinstance(state, dict | list | tuple):
        return {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    return {k: v for key, item in items for k, v in tensors(item, f"{path}/{key}").items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    root = tmp_path_factory.mktemp("grid")
    # An optimizer's first construction imports torch's compiler (about 1.5 s): once, here,
    # rather than in each of the 24 ranks forked below.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    states = {}
    for world in SAVED_AT:
        results = launch(save_both, world, args=(str(root),), backend="gloo", start_method="fork")
        states[world] = results[0]
    return root, states


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loaded_at", LOADED_AT)
def test_sharded_checkpoint_loads_at_any_world_size(
    saved: tuple[Path, dict[int, Any]], loaded_at: int
) -> None:
    root, states = saved
    results = launch(load_all, loaded_at, args=(str(root),), backend="gloo", start_method="fork")
    for strategy in STRATEGIES:
        for saved_at in SAVED_AT:
            case = f"{strategy} saved at {saved_at}"
            got, want = results[0][case], states[saved_at][strategy]
            assert differences(want["saved"], got["loaded"]) == [], case
            after, uninterrupted = tensors(got["after"]), tensors(want["after"])
            assert after.keys() == uninterrupted.keys(), case
            for name, value in after.items():
                torch.testing.assert_close(
                    value, uninterrupted[name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}"
                )
