"""The compare command's training loop trains every strategy identically to DDP."""

from __future__ import annotations

import pytest

from fsdp_guide import launch
from fsdp_guide.compare._runs import train_and_measure


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["sharded_ddp", "sharded_ddp_buckets", "fsdp", "fsdp2"])
def test_last_loss_after_several_steps_equals_ddp(strategy: str) -> None:
    # Four steps: a gradient lost between steps (e.g. ShardedDDP buckets detached by
    # set-to-None zeroing) first changes the third loss.
    def last_losses(name: str) -> list[float]:
        results = launch(train_and_measure, 2, args=(name, "mlp", 4), start_method="fork")
        return [r.loss for r in results]

    assert last_losses(strategy) == pytest.approx(last_losses("ddp"), rel=1e-5)
