"""Sharded checkpoints of PyTorch FSDP1 and FSDP2 load at another world size than saved them.

The reference for "resumes exactly" is the full checkpoint of the same state, saved beside the
sharded one and loaded at the new world size: both must give the same state, bit for bit,
and the same next losses (the full path is itself checked against uninterrupted runs in
test_checkpointing_sharded.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, differences, snapshot, train

from fsdp_guide import checkpoint, launch

STEPS_BEFORE = 2
STEPS_AFTER = 3
BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
# (saving strategy, world size), (loading strategy, world size)
CASES = [
    ("fsdp1", 2, "fsdp1", 1),
    ("fsdp1", 2, "fsdp1", 4),
    ("fsdp1", 4, "fsdp1", 2),
    ("fsdp2", 2, "fsdp2", 1),
    ("fsdp2", 2, "fsdp2", 4),
    ("fsdp2", 4, "fsdp2", 2),
    ("fsdp1", 2, "fsdp2", 4),  # DCP keys both by parameter name: they load each other's
    ("fsdp2", 4, "fsdp1", 2),
    ("fsdp1", 2, "fsdp1", 3),  # uneven: rows do not split into equal shards
    ("fsdp2", 4, "fsdp2", 3),
]


def train_and_save(rank: int, world_size: int, strategy: str, sharded: str, full: str) -> Any:
    torch.set_num_threads(1)  # 4 ranks share 2 cores; more threads only contend
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, start=0, steps=STEPS_BEFORE, global_batch=BATCH)
    checkpoint.save(sharded, model, optimizer, kind="sharded", extra={"step": STEPS_BEFORE})
    checkpoint.save(full, model, optimizer, kind="full", extra={"step": STEPS_BEFORE})
    return snapshot(model, optimizer, strategy)  # the full state, taken with DCP's own API


def load_both_and_train(rank: int, world_size: int, strategy: str, sharded: str, full: str) -> Any:
    torch.set_num_threads(1)
    model, optimizer = build(strategy, seed=1)  # other weights, no optimizer state
    fresh = snapshot(model, optimizer, strategy)["model"]
    extra = checkpoint.load(sharded, model, optimizer)
    loaded = snapshot(model, optimizer, strategy)
    resumed = train(model, optimizer, start=STEPS_BEFORE, steps=STEPS_AFTER, global_batch=BATCH)

    reference_model, reference_optimizer = build(strategy, seed=2)
    checkpoint.load(full, reference_model, reference_optimizer)
    reference = train(
        reference_model, reference_optimizer, STEPS_BEFORE, STEPS_AFTER, global_batch=BATCH
    )
    return {
        "loaded": loaded,
        "fresh_differed": bool(differences(fresh, loaded["model"])),
        "extra": extra,
        "resumed": resumed,
        "reference": reference,
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("source", "saved_on", "target", "loaded_on"),
    CASES,
    ids=[f"{s}x{a}-to-{t}x{b}" for s, a, t, b in CASES],
)
def test_sharded_checkpoint_loads_at_another_world_size(
    tmp_path: Path, source: str, saved_on: int, target: str, loaded_on: int
) -> None:
    sharded, full = str(tmp_path / "sharded"), str(tmp_path / "full.pt")
    started = time.monotonic()
    saved = launch(
        train_and_save,
        saved_on,
        args=(source, sharded, full),
        backend="gloo",
        start_method="fork",
        timeout=100,
    )
    results = launch(
        load_both_and_train,
        loaded_on,
        args=(target, sharded, full),
        backend="gloo",
        start_method="fork",
        timeout=100,
    )
    assert time.monotonic() - started < 200  # bounded even if a collective were to stall
    for rank, result in enumerate(results):
        assert result["fresh_differed"], "the fresh model must start from other weights"
        assert differences(saved[0], result["loaded"]) == [], f"rank {rank}: not bit-equal"
        assert result["extra"] == {"step": STEPS_BEFORE}
        assert len(result["resumed"]) == STEPS_AFTER
        assert result["resumed"] == result["reference"], f"rank {rank}"
    # The shards came from every saving rank: each wrote its own data file.
    assert len(list((tmp_path / "sharded").glob("data-*/*.distcp"))) == saved_on


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["fsdp1", "fsdp2"])
def test_sharded_checkpoint_loads_into_a_plain_module_in_one_process(
    tmp_path: Path, source: str
) -> None:
    sharded, full = str(tmp_path / "sharded"), str(tmp_path / "full.pt")
    saved = launch(
        train_and_save,
        2,
        args=(source, sharded, full),
        backend="gloo",
        start_method="fork",
        timeout=100,
    )
    # No process group here: what a user evaluating the model on one machine would do.
    result = load_both_and_train(0, 1, "module", sharded, full)
    assert result["fresh_differed"]
    assert differences(saved[0], result["loaded"]) == []
    assert result["extra"] == {"step": STEPS_BEFORE}
    assert result["resumed"] == result["reference"]
