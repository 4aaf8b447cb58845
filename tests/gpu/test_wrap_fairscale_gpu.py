"""FairScale's FullyShardedDataParallel through shard(), wrapping() and checkpoint_layers (CUDA).

FairScale's FSDP runs only on CUDA, so these tests carry the ``gpu`` marker and skip on
CPU machines. They run on as many GPUs as are visible, up to 2, with NCCL (one GPU: world
size 1). Each rank (:func:`gpu_wrap_ranks.run_fairscale`) also trains the unwrapped model on
the whole global batch as the reference. Ranks are spawned: earlier tests in the same pytest
process may have initialised CUDA, after which a forked child cannot use it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_wrap_ranks import CONFIGURATIONS, run_fairscale
from wrap_configurations import CONFIG, POLICIES, build

from fsdp_guide import launch
from fsdp_guide.models import count_params
from fsdp_guide.wrap import sharded_units

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def fairscale_results() -> list[dict[str, Any]]:
    world_size = min(2, torch.cuda.device_count())
    return launch(run_fairscale, world_size, backend="nccl", start_method="spawn", timeout=600)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_fairscale_losses_match_unwrapped_model(
    fairscale_results: list[dict[str, Any]], name: str
) -> None:
    for rank_result in fairscale_results:
        reference = rank_result["reference"]
        torch.testing.assert_close(rank_result[name]["losses"], reference, rtol=1e-5, atol=0)
        assert reference[-1] < reference[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_fairscale_units_are_exactly_those_selected(
    fairscale_results: list[dict[str, Any]], name: str
) -> None:
    units = fairscale_results[0][name]["units"]
    expected = {
        "manual": {"blocks.1", "head"},
        "layer+checkpoint": set(POLICIES["layer"].select(build())),
        "layer+torch-checkpoint": set(POLICIES["layer"].select(build())),
    }.get(name) or set(POLICIES[name].select(build()))
    assert set(units) == {""} | expected
    assert {kind for kind, _ in units.values()} == {"fairscale_fsdp"}
    assert sum(n for _, n in units.values()) == count_params(build())
    if name in POLICIES:
        planned = sharded_units(build(), policy=POLICIES[name])
        assert {k: n for k, (_, n) in units.items()} == {k: n for k, (_, n) in planned.items()}
    description = fairscale_results[0][name]["description"]
    assert description.count("[unit: fairscale_fsdp,") == len(units)
    if name.endswith("checkpoint"):
        assert description.count("[checkpointed]") == CONFIG.n_layers
