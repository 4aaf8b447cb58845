"""FairScale ``OSS`` over DDP: the optimizer state is sharded (ZeRO stage 1).

OSS keeps each rank's parameters as views of one flat buffer and the Adam state of the
tensors that rank owns. The parameters are handed to it largest first, so ranks own what
``ZeroRedundancyOptimizer`` would: the same layout and collectives (all-reduce ``Ψ``, then
broadcast ``Ψ``).

Examples:
    >>> OSS().collectives(1000, 2).payload
    {'all_reduce': 1000, 'broadcast': 1000}
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
from fsdp_guide.engines._checkpoint import consolidated_everywhere
from fsdp_guide.engines._partition import largest_first, owned_layout
from fsdp_guide.engines._records import Collectives, Layout
from fsdp_guide.engines.ddp import DDP

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


@dataclass(frozen=True)
class OSS(DDP):
    """DDP with FairScale's ``OSS`` around Adam (DDP's buckets, its own state)."""

    name = "oss"
    title = "FairScale OSS"
    maintenance = 2
    loads_dcp = False  # DCP does not fill its optimizer: a consolidated full file does

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        if "fairscale" not in sys.modules:  # an OSS can only exist once FairScale was imported
            return False
        from fairscale.optim import OSS as FairScaleOSS

        return isinstance(optimizer, FairScaleOSS)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from fairscale.optim import OSS as FairScaleOSS

        # OSS first: it turns each rank's parameters into views of one flat buffer.
        optimizer = FairScaleOSS(largest_first(model), optim=torch.optim.Adam, lr=lr)
        return self.wrap(model, device), optimizer

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
        """The whole optimizer state, consolidated on every rank (recipient -1)."""
        return self.unwrap(model).state_dict(), consolidated_everywhere(optimizer)

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"all_reduce": num_params, "broadcast": num_params})
