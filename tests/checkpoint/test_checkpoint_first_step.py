"""A checkpoint taken before the first optimizer step changes nothing and loads as taken.

DCP's state dict functions give an optimizer without state one by stepping it with lr 0
(step 1, zero moments); Adam's next update then differs. Saving must not do that to the
run it saves, and loading such a checkpoint must give an optimizer that has not stepped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, train

from fsdp_guide import checkpoint, launch

STEPS = 3


def save_at_step_0_then_train(rank: int, world_size: int, strategy: str, root: str) -> Any:
    torch.set_num_threads(1)
    never_saved, never_saved_optimizer = build(strategy, seed=0)
    reference = train(never_saved, never_saved_optimizer, start=0, steps=STEPS)
    results: dict[str, Any] = {"reference": reference}
    for kind, path in (("full", f"{root}/full.pt"), ("sharded", f"{root}/sharded")):
        model, optimizer = build(strategy, seed=0)
        checkpoint.save(path, model, optimizer, kind=kind)  # type: ignore[arg-type]
        state_after_save = len(optimizer.state)
        uninterrupted = train(model, optimizer, start=0, steps=STEPS)
        fresh, fresh_optimizer = build(strategy, seed=1)
        checkpoint.load(path, fresh, fresh_optimizer)
        state_after_load = len(fresh_optimizer.state)
        resumed = train(fresh, fresh_optimizer, start=0, steps=STEPS)
        results[kind] = (state_after_save, uninterrupted, state_after_load, resumed)
    return results


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_checkpoint_before_the_first_step(tmp_path: Path, strategy: str) -> None:
    results = launch(
        save_at_step_0_then_train,
        2,
        args=(strategy, str(tmp_path)),
        backend="gloo",
        start_method="fork",
        timeout=100,
    )
    for rank, result in enumerate(results):
        for kind in ("full", "sharded"):
            state_after_save, uninterrupted, state_after_load, resumed = result[kind]
            where = f"rank {rank}, {kind}"
            assert (state_after_save, state_after_load) == (0, 0), where
            assert uninterrupted == result["reference"], where
            assert resumed == result["reference"], where
