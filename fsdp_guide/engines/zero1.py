"""PyTorch ``ZeroRedundancyOptimizer`` over DDP: the optimizer state is sharded (ZeRO stage 1).

Each rank owns whole tensors (largest first, to the rank with the fewest elements so far)
and keeps the Adam state of those only. DDP all-reduces the whole gradient, then each owner
broadcasts the tensors it updated: payload ``Ψ`` of all-reduce and ``Ψ`` of broadcast.

Examples:
    >>> [s.optimizer for s in Zero1().layout([(10,), (7,)], 2)]
    [10, 7]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_guide.engines._base import Built
from fsdp_guide.engines._checkpoint import rank
from fsdp_guide.engines._partition import owned_layout
from fsdp_guide.engines._records import Collectives, Layout
from fsdp_guide.engines.ddp import DDP

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


@dataclass(frozen=True)
class Zero1(DDP):
    """DDP with torch's ``ZeroRedundancyOptimizer`` around Adam (DDP's buckets, its own state)."""

    name = "zero1"
    title = "ZeroRedundancyOptimizer"
    aliases = ("zero",)
    loads_dcp = False  # DCP does not fill its optimizer: a consolidated full file does

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
        layouts = owned_layout(shapes, world_size, owned_grads=False)
        return self.with_buckets(layouts, sum(math.prod(shape) for shape in shapes))

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The whole optimizer state on every rank: consolidated on rank 0, then broadcast
        (torch's ZeRO consolidates to one rank per call)."""
        import torch.distributed as dist

        model_state = dict(self.unwrap(model).state_dict())
        if optimizer is None:
            return model_state, None
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        whole = [optimizer.state_dict() if rank() == 0 else None]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(whole, src=0)
        assert whole[0] is not None
        return model_state, whole[0]

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"all_reduce": num_params, "broadcast": num_params})
