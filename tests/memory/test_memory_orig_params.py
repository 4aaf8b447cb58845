"""measure_model_state under FSDP1's use_orig_params=True (Lightning's default).

The module's parameters are then views of each unit's flat parameter: of the gathered copy
while a unit is unsharded, so the shard itself is reachable only through the flat
parameter. Measured between forward and backward, the bytes must be those of
use_orig_params=False, the same tensors in memory.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import ShardingStrategy

from fsdp_guide import launch
from fsdp_guide.memory import measure_model_state
from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, loss_fn, synthetic_batch
from fsdp_guide.wrap import LayerPolicy, shard

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)


def in_flight(rank: int, world_size: int) -> dict[Any, tuple[int, int]]:
    warnings.filterwarnings("ignore")
    held = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        for orig in (False, True):
            torch.manual_seed(0)
            model = shard(
                TinyTransformer(CONFIG),
                engine="fsdp1",
                policy=LayerPolicy(Block),
                sharding_strategy=ShardingStrategy[strategy],
                use_orig_params=orig,
            )
            optimizer = torch.optim.Adam(model.parameters())
            loss = loss_fn(model, synthetic_batch("transformer", 2, config=CONFIG))
            between = measure_model_state(model).params
            loss.backward()
            optimizer.step()
            held[(strategy, orig)] = (between, measure_model_state(model, optimizer).total)
    return held


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_original_parameters_count_the_same_bytes(strategy: str) -> None:
    results = launch(in_flight, 2, backend="gloo", start_method="fork")
    psi = sum(p.numel() for p in TinyTransformer(CONFIG).parameters())
    for held in results:
        flat, views = held[(strategy, False)], held[(strategy, True)]
        assert views[0] == flat[0]  # between forward and backward
        assert views[1] >= flat[1]  # after the step: Adam's step counter per tensor on top
    if strategy == "SHARD_GRAD_OP":  # every unit gathered, and the shards
        assert results[0][(strategy, True)][0] == 4 * psi + 4 * psi // 2
