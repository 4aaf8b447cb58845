"""FairScale ``ShardedDataParallel`` on ``OSS``: gradients sharded too (ZeRO stage 2).

Each gradient is reduced to the rank that owns its tensor, which updates it and broadcasts
it back (payload ``Ψ`` of reduce and ``Ψ`` of broadcast). Without reduce buckets
(``reduce_buffer_size=0``) a rank keeps only the gradients it owns; with them (FairScale's
default, 2**23 elements) the buckets stay allocated after they are reduced, so every rank
keeps a full-size gradient buffer.

Examples:
    >>> ShardedDDP(reduce_buffer_size=0).full_grads, ShardedDDP(reduce_buffer_size=2**23).full_grads
    (False, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_guide.engines._base import Built, Engine
from fsdp_guide.engines._checkpoint import consolidated_everywhere
from fsdp_guide.engines._partition import largest_first, owned_layout
from fsdp_guide.engines._records import Collectives, Layout, Transient

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


@dataclass(frozen=True, kw_only=True)
class ShardedDDP(Engine):
    """FairScale ``OSS`` + ``ShardedDataParallel`` with Adam.

    Attributes:
        reduce_buffer_size: ShardedDDP's reduce buckets in elements (0: none).
    """

    name = "sharded_ddp"
    title = "FairScale ShardedDDP"
    broadcasts_buffers = True  # ShardedDataParallel(broadcast_buffers=True), its default
    maintenance = 2
    reduce_buffer_size: int = 0

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        import sys

        if "fairscale" not in sys.modules:
            return False
        from fairscale.nn.data_parallel import ShardedDataParallel

        return isinstance(model, ShardedDataParallel)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        optimizer = OSS(largest_first(model), optim=torch.optim.Adam, lr=lr)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=self.reduce_buffer_size)
        return wrapped, optimizer

    @property
    def stage_at_step(self) -> int:
        return 2

    @property
    def full_grads(self) -> bool:
        return self.reduce_buffer_size > 0

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...]:
        return owned_layout(shapes, world_size, owned_grads=not self.full_grads)

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        return Transient(bytes=0, kind="none known beyond the state")

    def unwrap(self, model: nn.Module) -> nn.Module:
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The whole optimizer state, consolidated on every rank (recipient -1)."""
        return self.unwrap(model).state_dict(), consolidated_everywhere(optimizer)

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"reduce": num_params, "broadcast": num_params})
