"""record_units: which FSDP2 units hold their full parameters, collective by collective."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_guide.launcher import launch
from fsdp_guide.models import Block, build_model, loss_fn, shard_batch, synthetic_batch
from fsdp_guide.timeline import UnitTimeline, record_units
from fsdp_guide.wrap import LayerPolicy, shard


def _record(rank: int, world_size: int, options: dict) -> UnitTimeline:
    model = shard(build_model("transformer", seed=0), policy=LayerPolicy(Block), **options)
    batch = shard_batch(synthetic_batch("transformer", 8), rank, world_size)
    return record_units(model, lambda: loss_fn(model, batch), lambda loss: loss.backward())


BLOCKS = [f"blocks.{i}" for i in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_gathers_block_by_block_and_prefetches_in_backward() -> None:
    timelines = launch(_record, world_size=2, args=({},), start_method="fork")
    for timeline in timelines:
        forward = timeline.collectives("forward")
        assert forward == ["all-gather root", *(f"all-gather {b}" for b in BLOCKS)]
        backward = timeline.collectives("backward")
        # Every block gathered again, from the last; each block's gradients, then the root's.
        assert [c for c in backward if c.startswith("all-gather")] == [
            f"all-gather {b}" for b in reversed(BLOCKS)
        ]
        assert [c for c in backward if c.startswith("reduce-scatter")] == [
            *(f"reduce-scatter {b}" for b in reversed(BLOCKS)),
            "reduce-scatter root",
        ]
        # The next block is gathered before the current one's gradients are reduce-scattered.
        assert backward.index("all-gather blocks.2") < backward.index("reduce-scatter blocks.3")
        assert timeline.most_held("forward") == 2  # the root and one block
        assert timeline.most_held("backward") == 3  # the root, one block, the prefetched one


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_resharding_after_forward_backward_gathers_nothing() -> None:
    (timeline, _) = launch(
        _record, world_size=2, args=({"reshard_after_forward": False},), start_method="fork"
    )
    assert not [c for c in timeline.collectives("backward") if c.startswith("all-gather")]
    assert timeline.most_held("forward") == 5  # every unit, kept until backward
    assert sum(e.elements for e in timeline.events if e.kind == "all-gather") == sum(
        p.numel() for p in build_model("transformer").parameters()
    )


def test_a_model_without_units_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"no FSDP2 unit: shard it first"):
        record_units(nn.Linear(2, 2), lambda: None, lambda loss: None)
