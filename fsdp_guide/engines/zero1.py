"""PyTorch ``ZeroRedundancyOptimizer`` over DDP: the optimizer state is sharded (ZeRO stage 1).

Each rank owns whole tensors (largest first, to the rank with the fewest elements so far)
and keeps the Adam state of those only. DDP all-reduces the whole gradient, then each owner
broadcasts the tensors it updated: payload ``Ψ`` of all-reduce and ``Ψ`` of broadcast.

Examples:
    >>> [s.optimizer for s in Zero1().layout([(10,), (7,)], 2)]
    [10, 7]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_guide.engines._base import Built, Collectives, Layout
from fsdp_guide.engines._partition import owned_layout
from fsdp_guide.engines.ddp import DDP


@dataclass(frozen=True)
class Zero1(DDP):
    """DDP with torch's ``ZeroRedundancyOptimizer`` around Adam (DDP's buckets, its own state)."""

    name = "zero1"
    title = "DDP + PyTorch ZeroRedundancyOptimizer"
    aliases = ("zero",)

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        # Only once torch.distributed.optim was imported can one exist; importing it here
        # would script its functional optimizers (and warn) on every call.
        if "torch.distributed.optim" not in sys.modules:
            return False
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return isinstance(optimizer, ZeroRedundancyOptimizer)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        module = self.wrap(model, device)
        optimizer = ZeroRedundancyOptimizer(
            module.parameters(), optimizer_class=torch.optim.Adam, lr=lr
        )
        return module, optimizer

    @property
    def stage_at_step(self) -> int:
        return 1

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...]:
        return owned_layout(shapes, world_size, owned_grads=False)

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"all_reduce": num_params, "broadcast": num_params})
