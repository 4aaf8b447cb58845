"""The CUDA rank function of ``tests/gpu/test_wrap_fairscale_gpu.py``, importable by spawned ranks.

:func:`run_fairscale` shards the TinyTransformer with FairScale's FSDP in each configuration
(policies, manual wrapping, checkpointed Blocks) and trains it beside the unwrapped model.
"""

from __future__ import annotations

from typing import Any

import torch
from wrap_configurations import POLICIES, build, shard_configuration, train

from fsdp_guide.wrap import describe, sharded_units

# Blocks checkpointed by FairScale's wrapper, and by PyTorch's (which shard() replaces by
# FairScale's inside each unit: PyTorch's around a FairScale unit fails in backward).
CONFIGURATIONS = [*POLICIES, "manual", "layer+checkpoint", "layer+torch-checkpoint"]


def run_fairscale(rank: int, world_size: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    reference = train(build().to(device), 0, 1, device)  # whole batch, one process
    results: dict[str, Any] = {"reference": reference}
    for name in CONFIGURATIONS:
        model = shard_configuration(name, "fairscale_fsdp", device)
        results[name] = {
            "units": sharded_units(model),
            "description": describe(model),
            "losses": train(model, rank, world_size, device),
        }
    return results
