"""CUDA peak memory of a training step (CUDA only) against the ZeRO formula and activations.

A 303,360,000-parameter TinyTransformer, 8 sequences of 512 tokens, fp32 Adam, on one GPU:
plain, with each Block checkpointed, and under FairScale FSDP, each in a spawned NCCL rank
(:func:`gpu_ranks.peak_memory_rank`). The model state measured equals the ZeRO formula, and
the peak of forward and backward lies between the state plus the saved activations and 1.5
times that (transient buffers: the loss's gradient, attention workspace, recomputed blocks,
gathered units).
"""

from __future__ import annotations

import pytest
import torch
from gpu_ranks import BIG, peak_memory_rank

from fsdp_guide import launch
from fsdp_guide.memory import estimate_model_state
from fsdp_guide.models import TinyTransformer, count_params

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SLACK = 1.5


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("variant", "stage"), [("plain", 0), ("checkpointed", 0), ("fairscale", 3)]
)
def test_peak_of_a_step_is_state_plus_activations(variant: str, stage: int) -> None:
    with torch.device("meta"):
        n = count_params(TinyTransformer(BIG))
    assert n == 303_360_000
    (m,) = launch(
        peak_memory_rank, 1, args=(variant,), backend="nccl", start_method="spawn", timeout=240
    )
    predicted = estimate_model_state(n, 1, stage).total
    assert abs(m["state"] - predicted) / predicted < 1e-3
    assert m["state"] + m["activations"] <= m["peak"] <= SLACK * (predicted + m["activations"])
