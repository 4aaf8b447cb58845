"""saved_activation_bytes under FSDP on 2 gloo ranks equals the single-process count.

Under FSDP autograd also saves the gathered (unsharded) weights each layer needs in backward;
they are parameters, not activations, and FSDP frees and re-gathers them (reusing addresses),
so counting them would inflate the number and make it differ between ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from saved_bytes_targets import STEPS, WORLD_SIZE, build, local_batch, measure_fairscale

from fsdp_guide import launch
from fsdp_guide.models import Block, loss_fn
from fsdp_guide.wrap import LayerPolicy, saved_activation_bytes, shard

# (name, engine, engine options): default resharding, and gathered weights kept after forward.
SETTINGS: list[tuple[str, str, dict[str, Any]]] = [
    ("fsdp1", "torch", {}),
    ("fsdp1-shard-grad-op", "torch", {"sharding_strategy": "SHARD_GRAD_OP"}),
    ("fsdp1-orig-params", "torch", {"use_orig_params": True}),
    ("fsdp2", "fsdp2", {}),
    ("fsdp2-no-reshard", "fsdp2", {"reshard_after_forward": False}),
]


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import ShardingStrategy

    if "sharding_strategy" in options:
        return {**options, "sharding_strategy": ShardingStrategy[options["sharding_strategy"]]}
    return options


def measure_sharded(rank: int, world_size: int) -> dict[tuple[str, bool], list[int]]:
    results: dict[tuple[str, bool], list[int]] = {}
    for name, engine, options in SETTINGS:
        for checkpointed in (False, True):
            model = shard(
                build(checkpointed),
                engine=engine,  # type: ignore[arg-type]
                policy=LayerPolicy(Block),
                **engine_options(options),
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            counts = []
            for step in range(STEPS):
                batch = local_batch(rank, step)
                nbytes, loss = saved_activation_bytes(model, lambda: loss_fn(model, batch))  # noqa: B023
                loss.backward()
                optimizer.step()
                model.zero_grad()
                counts.append(nbytes)
            results[(name, checkpointed)] = counts
    return results


@pytest.fixture(scope="module")
def sharded_counts() -> list[dict[tuple[str, bool], list[int]]]:
    return launch(measure_sharded, WORLD_SIZE, backend="gloo", start_method="fork")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("setting", [name for name, _, _ in SETTINGS])
def test_sharded_saved_bytes_equal_single_process(
    sharded_counts: list[dict[tuple[str, bool], list[int]]], setting: str, checkpointed: bool
) -> None:
    model = build(checkpointed)
    expected, _ = saved_activation_bytes(model, lambda: loss_fn(model, local_batch(0, 0)))
    for rank, counts in enumerate(sharded_counts):
        assert counts[(setting, checkpointed)] == [expected] * STEPS, f"rank {rank}"


def test_single_process_counts_differ_with_checkpointing() -> None:
    """The comparison above is not vacuous: checkpointing changes the count."""
    counts = []
    for checkpointed in (False, True):
        model = build(checkpointed)
        nbytes, _ = saved_activation_bytes(model, lambda: loss_fn(model, local_batch(0, 0)))  # noqa: B023
        counts.append(nbytes)
    assert counts[1] < counts[0]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fairscale_fsdp_saved_bytes_equal_single_process() -> None:
    world_size = min(WORLD_SIZE, torch.cuda.device_count())
    # Spawned: a forked child cannot use CUDA once an earlier test initialised it here.
    results = launch(
        measure_fairscale, world_size, backend="nccl", start_method="spawn", timeout=600
    )
    for rank, result in enumerate(results):
        for checkpointed, counts in result.items():
            assert counts["sharded"] == counts["expected"], f"rank {rank}, {checkpointed=}"
        assert result[True]["expected"][0] < result[False]["expected"][0]
