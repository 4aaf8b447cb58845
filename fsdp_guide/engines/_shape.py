"""What a step's collectives depend on beyond ``Ψ``: :class:`ModelShape` (private)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fsdp_guide.engines._step import ModuleCalls


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What a step's collectives depend on beyond ``Ψ``: the units' shapes and the buffers.

    Attributes:
        units: The shape of each parameter of each unit, the root unit first (a model that
            is not cut into units is one root unit). A shared parameter is in one unit only.
        buffers: Elements of the model's buffers (BatchNorm statistics, position ids), which
            DDP broadcasts from rank 0 before every forward.
        calls: The order forward runs the modules in, with their parameters, where an
            engine's collectives follow it (DeepSpeed ZeRO-3 gathers again what it released);
            ``None`` where not known.

    Examples:
        >>> shape = ModelShape(units=(((4, 2),), ((3,), (5, 5))), buffers=7)
        >>> shape.num_params, shape.root_params
        (36, 8)
    """

    units: tuple[tuple[tuple[int, ...], ...], ...]
    buffers: int = 0
    calls: ModuleCalls | None = field(default=None, compare=False, repr=False)

    @property
    def num_params(self) -> int:
        """``Ψ``: the parameters of every unit."""
        return sum(math.prod(shape) for unit in self.units for shape in unit)

    @property
    def root_params(self) -> int:
        """The root unit's parameters."""
        return sum(math.prod(shape) for shape in self.units[0]) if self.units else 0

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, unit after unit."""
        return tuple(shape for unit in self.units for shape in unit)
