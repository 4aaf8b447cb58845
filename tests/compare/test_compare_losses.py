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


def threads_before_and_after_training(rank: int, world_size: int) -> tuple[int, int]:
    """This rank's intra-op thread count as launch set it, and after training like compare."""
    import torch

    before = torch.get_num_threads()
    train_and_measure(rank, world_size, "ddp", "mlp", 1)
    return before, torch.get_num_threads()


@pytest.mark.timeout(180)
def test_training_keeps_the_thread_count_launch_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    # A spawned rank gets cpu_count // world_size threads from launch (one thread is for
    # forked ranks only); the training function used to force one thread over that choice.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ((before, after),) = launch(
        threads_before_and_after_training, 1, start_method="spawn", backend="gloo"
    )
    assert after == before
