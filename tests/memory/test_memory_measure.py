"""measure_model_state on launched gloo ranks, for every CPU strategy at world sizes 1, 2, 4.

Expected bytes are computed here from parameter shapes and each strategy's sharding rule
(FSDP pads its flat parameter to a multiple of the world size; FSDP2 pads each tensor's
dim 0; OSS/ZeRO give whole tensors to ranks), not read back from the run.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_guide.catalog import cpu_strategies
from fsdp_guide.engines import engine_for, wrap_for_strategy
from fsdp_guide.launcher import launch
from fsdp_guide.memory import measure_model_state, predict_model_state
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

# DeepSpeed engines step through engine.backward/engine.step and hold their state in their own
# buffers: measured and counted in tests/deepspeed/.
CPU_STRATEGIES = cpu_strategies(deepspeed=False)
PADDING_STRATEGIES = ["fsdp", "fsdp_grad_op", "fsdp_hybrid", "fsdp2", "fsdp2_hybrid"]
STEP_BYTES = 4  # Adam's fp32 step counter, one per optimized tensor
pytestmark = pytest.mark.slow


def odd_model() -> nn.Module:
    """23 parameters: no world size > 1 divides them, and dim 0 of each tensor is small."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _odd_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _train_and_measure_all(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Two Adam steps per (model, strategy); state measured after the last step()."""
    runs = [("transformer", name) for name in CPU_STRATEGIES]
    runs += [("odd", name) for name in PADDING_STRATEGIES]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for model_kind, name in runs:
        model = build_model("transformer") if model_kind == "transformer" else odd_model()
        module, optimizer = wrap_for_strategy(model, name, world_size)
        losses = []
        for step in range(2):
            batch = (
                synthetic_batch("transformer", 8, step)
                if model_kind == "transformer"
                else (_odd_batch(step))
            )
            loss = loss_fn(module, shard_batch(batch, rank, world_size))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step == 1:
                state = measure_model_state(module, optimizer)
            module.zero_grad()  # ShardedDDP clears its buckets in place this way
        local = getattr(optimizer, "optim", optimizer)  # OSS / ZeRO: this rank's optimizer
        owned = [p.numel() for group in local.param_groups for p in group["params"]]
        out[(model_kind, name)] = {"state": state, "owned": owned, "losses": losses}
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"ws{n}")
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[tuple[str, str], Any]]]:
    world_size: int = request.param
    results = launch(
        _train_and_measure_all, world_size, backend="gloo", start_method="fork", timeout=280
    )
    return world_size, results


def _shapes(model: nn.Module) -> list[torch.Size]:
    return [p.shape for p in model.parameters()]


def _unit_numels(model: nn.Module) -> list[int]:
    """Parameters of each FSDP1 unit: the root (all but the blocks), then each block."""
    blocks = list(getattr(model, "blocks", []))
    inside = sum(p.numel() for block in blocks for p in block.parameters())
    root = sum(p.numel() for p in model.parameters()) - inside
    return [root, *(sum(p.numel() for p in block.parameters()) for block in blocks)]


def expected_bytes(
    name: str,
    shapes: list[torch.Size],
    world_size: int,
    rank: int,
    owned: list[int],
    units: list[int],
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes this rank should hold, fp32 Adam.

    ``units``: the parameters of each FSDP1 unit (a flat parameter each).
    """
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    full = (4 * total, 4 * total, 8 * total + STEP_BYTES * len(numels))
    if name in ("ddp", "fsdp_no_shard"):
        return (
            full if name == "ddp" else (4 * total, 4 * total, 8 * total + STEP_BYTES * len(units))
        )
    shard_state = 8 * sum(owned) + STEP_BYTES * len(owned)
    if name in ("zero1", "oss", "sharded_ddp_buckets"):
        return 4 * total, 4 * total, shard_state
    if name == "sharded_ddp":
        return 4 * total, 4 * sum(owned), shard_state
    if name in ("fsdp", "fsdp_grad_op", "fsdp_hybrid"):
        group = engine_for(name).shard_group_size(world_size)
        # A flat parameter per unit, each padded to a multiple of group.
        shard = sum(math.ceil(unit / group) for unit in units)
        return 4 * shard, 4 * shard, 8 * shard + STEP_BYTES * len(units)
    # Each tensor cut along dim 0 into padded chunks; kept gathered after forward or offloaded
    # to host memory (on a CPU run, the same memory), the state between steps is the same.
    if name in ("fsdp2", "fsdp2_hybrid", "fsdp2_no_reshard", "fsdp2_offload"):
        group = engine_for(name).shard_group_size(world_size)  # HSDP: shard within pairs
        padded = local = 0
        for shape in shapes:
            rows = math.ceil(shape[0] / group)
            rest = math.prod(shape[1:])
            padded += rows * rest
            local += max(0, min(rows, shape[0] - rank % group * rows)) * rest
        return 4 * padded, 4 * padded, 8 * local + STEP_BYTES * len(shapes)
    raise AssertionError(f"no expectation for {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CPU_STRATEGIES)
def test_measured_bytes_match_shapes(runs: Any, name: str) -> None:
    world_size, results = runs
    shapes = _shapes(build_model("transformer"))
    for rank, result in enumerate(results):
        got = result[("transformer", name)]
        state = got["state"]
        units = _unit_numels(build_model("transformer"))
        want = expected_bytes(name, shapes, world_size, rank, got["owned"], units)
        assert (state.params, state.grads, state.optimizer) == want, f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PADDING_STRATEGIES)
def test_fsdp_padding_is_counted(runs: Any, name: str) -> None:
    world_size, results = runs
    shapes = _shapes(odd_model())
    for rank, result in enumerate(results):
        state = result[("odd", name)]["state"]
        want = expected_bytes(name, shapes, world_size, rank, [], _unit_numels(odd_model()))
        assert (state.params, state.grads, state.optimizer) == want, f"rank {rank}"
    if world_size > 1 and name != "fsdp_hybrid":
        # 23 parameters never divide evenly: the shards together exceed the model.
        assert sum(r[("odd", name)]["state"].params for r in results) > 4 * 23


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero1", "oss", "sharded_ddp"])
def test_optimizer_shards_cover_every_tensor_once(runs: Any, name: str) -> None:
    _, results = runs
    numels = sorted(p.numel() for p in build_model("transformer").parameters())
    owned = sorted(n for result in results for n in result[("transformer", name)]["owned"])
    assert owned == numels
    total_optimizer = sum(r[("transformer", name)]["state"].optimizer for r in results)
    assert total_optimizer == 8 * sum(numels) + STEP_BYTES * len(numels)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CPU_STRATEGIES)
def test_measured_over_predicted_within_two_percent(runs: Any, name: str) -> None:
    world_size, results = runs
    num_params = sum(p.numel() for p in build_model("transformer").parameters())
    predicted = predict_model_state(name, num_params, world_size)
    for rank, result in enumerate(results):
        ratio = result[("transformer", name)]["state"].total / predicted.total
        assert abs(ratio - 1) < 0.02, f"rank {rank}: ratio {ratio:.4f}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in CPU_STRATEGIES if n != "ddp"])
def test_sharded_training_matches_ddp_losses(runs: Any, name: str) -> None:
    _, results = runs
    for rank, result in enumerate(results):
        reference = result[("transformer", "ddp")]["losses"]
        got = result[("transformer", name)]["losses"]
        assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), f"rank {rank}"
        assert got[1] != got[0]  # the second loss saw an update


def test_more_ranks_hold_less(runs: Any) -> None:
    world_size, results = runs
    state = results[0][("transformer", "fsdp")]["state"]
    full = results[0][("transformer", "ddp")]["state"]
    assert state.total * world_size == pytest.approx(full.total, rel=1e-3)
