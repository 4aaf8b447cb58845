"""No engine: a plain module on one process, its optimizer beside it.

What :func:`fsdp_guide.engines.engine_for` names a model that no engine wrapped, so that
checkpoints and measuring treat it like any other (it holds what DDP holds, and sends
nothing).

Examples:
    >>> Plain().collectives(1000, 1).payload
    {}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_guide.engines._base import Built, Engine, adam
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines.ddp import DDP

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


@dataclass(frozen=True)
class Plain(Engine):
    """A module trained without an engine."""

    name = "module"
    title = "a plain module"
    loads_dcp = True

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        return True

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        return model, adam(model.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 0

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        return DDP().layout(shapes, world_size)  # what a DDP rank holds

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        return Transient(bytes=0, kind="none known beyond the state")

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return Collectives(payload={})
