"""What ``examples/fsdp2_hsdp.py`` should measure: the unsharded losses, and the bytes predicted.

The prediction for FSDP2 HSDP with two ranks per node is the planner's
(:func:`fsdp_guide.memory.plan` of the catalog's ``"fsdp2_hybrid"``, FSDP2 on a (replicate,
shard) mesh in pairs): model state per rank, and payloads of reduce-scatter ``Ψ`` and
all-gather ``2Ψ - R`` inside the node, all-reduce ``Ψ/S`` across.

The number of calls is FSDP2's, one collective per unit and direction: an all-gather per unit
in forward and again in backward except the root's (kept unsharded in between), one
reduce-scatter and one all-reduce per unit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_guide.memory import ModelState, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp2_train import LAYERS, Model, batch, loss_of

FP32 = 4


@dataclass(frozen=True)
class HSDPPrediction:
    """Bytes one rank holds, and its collectives of one step: (where, kind) -> (calls, bytes)."""

    state: ModelState
    collectives: dict[tuple[str, str], tuple[int, int]]
    source: str  # which prediction, named in the benchmark's table


def hsdp_prediction(nodes: int, ranks_per_node: int) -> HSDPPrediction:
    """The prediction for the example's model on ``nodes`` x ``ranks_per_node`` ranks."""
    model = Model()
    if ranks_per_node != 2:
        raise ValueError(f"fsdp2_hybrid shards in pairs; got {ranks_per_node} ranks per node")
    world = nodes * ranks_per_node
    planned = plan(
        model, batch_size=1, seq_len=1, world_size=world, strategy="fsdp2_hybrid", activations=0
    )
    state, payload = planned.ranks[0], planned.communication.payload
    units = LAYERS + 1
    return HSDPPrediction(
        state=state,
        collectives={
            ("within node", "all_gather"): (2 * units - 1, payload["all_gather"] * FP32),
            ("within node", "reduce_scatter"): (units, payload["reduce_scatter"] * FP32),
            ("across nodes", "all_reduce"): (units, payload["all_reduce"] * FP32),
        },
        source="the planner's fsdp2_hybrid",
    )


def unsharded_losses(steps: int) -> list[float]:
    """The example's training in one process on the whole batch, without any sharding."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            loss = loss_of(model, batch(step, 0, 1, torch.device("cpu")))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses
