"""``fsdp2_hybrid``: FSDP2 on a (replicate, shard) mesh, added through the engine adapter only.

Four gloo ranks in two shard groups of two: the losses equal an unsharded run's, each rank
holds what the adapter's layout says, and the collectives of a step are what the adapter
predicts, kind by kind (the all-reduce across the replicas included).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_guide.compare import ComparisonRow, run_comparison
from fsdp_guide.engines import FSDP2, engine_for
from fsdp_guide.memory import state_per_rank
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

WORLD_SIZE = 4
STEPS = 3
MODEL = "transformer"
BATCH = 8


@pytest.fixture(scope="module")
def rows() -> list[ComparisonRow]:
    return run_comparison(
        ["fsdp2_hybrid"], world_size=WORLD_SIZE, model_name=MODEL, steps=STEPS,
        batch_size=BATCH, progress=None, timeout=300,
    )  # fmt: skip


def _unsharded_last_losses() -> list[float]:
    """Each rank's slice loss at the last step of one process training the whole batch."""
    torch.manual_seed(0)
    model = build_model(MODEL)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        batch = synthetic_batch(MODEL, BATCH, step)
        if step == STEPS - 1:
            with torch.no_grad():
                return [
                    loss_fn(model, shard_batch(batch, r, WORLD_SIZE)).item()
                    for r in range(WORLD_SIZE)
                ]
        loss_fn(model, batch).backward()
        adam.step()
        adam.zero_grad()
    raise AssertionError("unreachable")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_losses_equal_an_unsharded_run(rows: list[ComparisonRow]) -> None:
    losses = [row.loss for row in sorted(rows, key=lambda r: r.rank)]
    assert losses == pytest.approx(_unsharded_last_losses(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_rank_holds_the_layout_of_its_shard_group(rows: list[ComparisonRow]) -> None:
    shapes = [tuple(p.shape) for p in build_model(MODEL).parameters()]
    predicted, exact = state_per_rank("fsdp2_hybrid", shapes, WORLD_SIZE)
    assert exact
    for row in rows:
        assert row.measured == predicted[row.rank], row.rank
    # Sharded in pairs: twice what FSDP2 over all four ranks holds, half of DDP's parameters.
    over_all, _ = state_per_rank("fsdp2", shapes, WORLD_SIZE)
    assert rows[0].measured.params == 2 * over_all[0].params


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_collectives_are_the_predicted_ones_kind_by_kind(rows: list[ComparisonRow]) -> None:
    for row in rows:
        measured, predicted = row.comm_measured, row.comm_predicted
        assert measured is not None and predicted is not None
        assert measured.complete, measured.reason
        assert measured.elements_by_kind() == dict(predicted.payload), row.rank
    # The replicas' all-reduce of each rank's gradient shard: Ψ / 2, over 2 groups.
    psi = rows[0].comm_predicted.num_params  # type: ignore[union-attr]
    assert rows[0].comm_predicted.payload["all_reduce"] == psi // 2  # type: ignore[union-attr]
    assert rows[0].comm_predicted.group_sizes["all_reduce"] == 2  # type: ignore[union-attr]


def test_the_row_is_fsdp2_with_a_shard_group() -> None:
    engine = engine_for("fsdp2_hybrid")
    assert engine == FSDP2(shard_group=2)
    assert [engine.shard_group_size(n) for n in (2, 3, 4, 8)] == [2, 3, 2, 2]
    with pytest.raises(ValueError, match="shard_group must be an int >= 1 or None"):
        FSDP2(shard_group=0)
