"""What ``examples/fsdp2_hsdp.py`` should measure: the unsharded losses, and the bytes predicted.

The prediction for FSDP2 HSDP with two ranks per node is the planner's
(:func:`fsdp_guide.memory.plan` of the catalog's ``"fsdp2_hybrid"``, FSDP2 on a (replicate,
shard) mesh in pairs) when the catalog has that strategy. Until it does, it is composed here,
local to the tests and the benchmark, from two planner pieces:

- model state per rank: :func:`fsdp_guide.memory.plan` of ``"fsdp2"`` over one node's ranks
  (HSDP shards like FSDP2 within the shard group and keeps one such copy per node);
- collectives: ``predict_communication`` of ``"fsdp_hybrid"`` (FSDP1 ``HYBRID_SHARD`` in pairs
  moves the same payloads as FSDP2 HSDP with two ranks per node: reduce-scatter ``Ψ`` and
  all-gather ``2Ψ - R`` inside the node, all-reduce ``Ψ/S`` across).

The number of calls is FSDP2's, one collective per unit and direction: an all-gather per unit
in forward and again in backward except the root's (kept unsharded in between), one
reduce-scatter and one all-reduce per unit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_guide.catalog import STRATEGIES
from fsdp_guide.memory import ModelState, plan

try:  # where communication is predicted once the engine adapters have landed
    from fsdp_guide.comm import predict_communication
except ImportError:
    from fsdp_guide.memory import predict_communication

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp2_train import LAYERS, Model, batch, loss_of

FP32 = 4


@dataclass(frozen=True)
class HSDPPrediction:
    """Bytes one rank holds, and its collectives of one step: (where, kind) -> (calls, bytes)."""

    state: ModelState
    collectives: dict[tuple[str, str], tuple[int, int]]
    source: str  # which prediction: the planner's fsdp2_hybrid, or composed here


def hsdp_prediction(nodes: int, ranks_per_node: int) -> HSDPPrediction:
    """The prediction for the example's model on ``nodes`` x ``ranks_per_node`` ranks."""
    model = Model()
    psi = sum(p.numel() for p in model.parameters())
    root = psi - sum(p.numel() for p in model.blocks.parameters())  # embedding and head
    world = nodes * ranks_per_node
    if "fsdp2_hybrid" in STRATEGIES and ranks_per_node == 2:  # the catalog's: in pairs
        planned = plan(
            model, batch_size=1, seq_len=1, world_size=world, strategy="fsdp2_hybrid",
            activations=0,
        )  # fmt: skip
        state, payload = planned.ranks[0], planned.communication.payload
        source = "the planner's fsdp2_hybrid"
    else:
        state = plan(
            model, batch_size=1, seq_len=1, world_size=ranks_per_node, strategy="fsdp2",
            activations=0,
        ).ranks[0]  # fmt: skip
        payload = predict_communication(
            "fsdp_hybrid", psi, world, "fp32", root_unit_params=root
        ).payload
        source = "composed: fsdp2's state over a node, fsdp_hybrid's payloads"
    units = LAYERS + 1
    return HSDPPrediction(
        state=state,
        collectives={
            ("within node", "all_gather"): (2 * units - 1, payload["all_gather"] * FP32),
            ("within node", "reduce_scatter"): (units, payload["reduce_scatter"] * FP32),
            ("across nodes", "all_reduce"): (units, payload["all_reduce"] * FP32),
        },
        source=source,
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
