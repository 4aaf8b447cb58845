"""PyTorch ``DistributedDataParallel``: every rank holds everything (ZeRO stage 0).

DDP keeps the whole model, its gradients and the optimizer state on every rank and
all-reduces the gradients in buckets during backward (one all-reduce of ``Ψ`` per step). With
``gradient_as_bucket_view=True`` the gradients are views of those buckets, so there is one
copy to count.

Examples:
    >>> engine = DDP()
    >>> engine.stage_at_step, engine.collectives(1000, 4).payload
    (0, {'all_reduce': 1000})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_guide.engines._base import (
    Built,
    Collectives,
    Engine,
    Layout,
    Transient,
    adam,
    replicated,
)

__all__ = ["DDP"]

# DDP's default bucket_cap_mb: the largest gradient bucket all-reduced at once.
DDP_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class DDP(Engine):
    """PyTorch ``DistributedDataParallel`` with torch's Adam."""

    name = "ddp"
    title = "PyTorch DDP"
    loads_dcp = True
    broadcasts_buffers = True

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)

    def unwrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return model.module if isinstance(model, DistributedDataParallel) else model

    @staticmethod
    def wrap(model: nn.Module, device: torch.device) -> nn.Module:
        """``DistributedDataParallel`` on ``device``, gradients as views of its buckets."""
        from torch.nn.parallel import DistributedDataParallel

        ids = [device] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        module = self.wrap(model, device)
        return module, adam(module.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 0

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        """Every tensor, its gradient and its optimizer state, on every rank.

        Examples:
            >>> DDP().layout([(10,), (7,)], 2)[1]
            Layout(params=17, grads=17, optimizer=17, steps=2, master=0, buckets=0, master_grads=0)
        """
        total = sum(math.prod(shape) for shape in shapes)
        one = Layout(params=total, grads=total, optimizer=total, steps=len(shapes))
        return replicated(world_size, one)

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        """DDP copies gradients into buckets of at most 25 MiB to all-reduce them."""
        return Transient(
            bytes=min(DDP_BUCKET_BYTES, grad_bytes * num_params),
            kind="gradient bucket (DDP's 25 MiB cap)",
        )

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={"all_reduce": num_params})
