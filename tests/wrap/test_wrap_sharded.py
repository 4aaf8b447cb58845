"""Sharding with policies and manual wrapping on 2 gloo ranks: loss parity and describe().

One launch per engine runs every configuration in turn (launching costs more than
training this small model), and the tests below check each configuration's result.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from wrap_configurations import (
    CONFIG,
    GLOBAL_BATCH,
    POLICIES,
    STEPS,
    build,
    shard_configuration,
    train,
)

from fsdp_guide import launch
from fsdp_guide.models import count_params, loss_fn, synthetic_batch
from fsdp_guide.wrap import describe, sharded_units

WORLD_SIZE = 2

# What each configuration must make units of, besides the root. Sizes in CONFIG: tok_emb and
# head 2,048 parameters, pos_emb 512, a block 12,704 of which qkv 3,168, fc1 4,224, fc2 4,128;
# so with 2,000 a block's remainder (1,184) stays with the root.
EXPECTED_UNITS = {
    "size": {"tok_emb", "head"}
    | {f"blocks.{i}.{layer}" for i in range(2) for layer in ("qkv", "fc1", "fc2")},
    "layer": {"blocks.0", "blocks.1"},
    "union": {"tok_emb", "pos_emb", "blocks.0", "blocks.1"},
    "manual": {"blocks.1", "head"},
    "layer+checkpoint": {"blocks.0", "blocks.1"},
}
CONFIGURATIONS = list(EXPECTED_UNITS)


def run_all(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in CONFIGURATIONS:
        model = shard_configuration(name, engine)
        units = sharded_units(model)
        results[name] = {
            "units": units,
            "description": describe(model),
            "losses": train(model, rank, world_size),
        }
    return results


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    """The unwrapped model trained in one process on the whole global batch."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        batch = synthetic_batch("transformer", GLOBAL_BATCH, step=step, config=CONFIG)
        loss = loss_fn(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module", params=["fsdp1", "fsdp2"])
def engine_results(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    engine: str = request.param
    results = launch(run_all, WORLD_SIZE, args=(engine,), backend="gloo", start_method="fork")
    return engine, results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_sharded_losses_match_unwrapped_model(
    engine_results: tuple[str, list[dict[str, Any]]], reference_losses: list[float], name: str
) -> None:
    _, results = engine_results
    for rank_result in results:
        losses = rank_result[name]["losses"]
        assert len(losses) == STEPS
        torch.testing.assert_close(losses, reference_losses, rtol=1e-5, atol=0)
    assert reference_losses[-1] < reference_losses[0]  # it trains, so parity means something


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_units_are_exactly_those_selected(
    engine_results: tuple[str, list[dict[str, Any]]], name: str
) -> None:
    engine, results = engine_results
    units = results[0][name]["units"]
    assert set(units) == {""} | EXPECTED_UNITS[name]
    assert {kind for kind, _ in units.values()} == {engine}
    # Every parameter element is managed by exactly one unit.
    assert sum(n for _, n in units.values()) == count_params(build())
    if name in POLICIES:
        planned = sharded_units(build(), policy=POLICIES[name])
        assert {k: n for k, (_, n) in units.items()} == {k: n for k, (_, n) in planned.items()}
    description = results[0][name]["description"]
    marked = [line for line in description.splitlines() if f"[unit: {engine}," in line]
    assert len(marked) == len(units)
    if name == "layer+checkpoint":
        assert description.count("[checkpointed]") == CONFIG.n_layers


@pytest.mark.parametrize("name", list(POLICIES))
def test_expected_units_follow_from_parameter_counts(name: str) -> None:
    """The hand-written EXPECTED_UNITS agree with what the policy rule gives on this model."""
    assert set(POLICIES[name].select(build())) == EXPECTED_UNITS[name]
