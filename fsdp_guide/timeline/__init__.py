"""One training step in time: each rank's bytes by category, and its collectives.

:func:`record_step` runs a forward, backward and optimizer step under torch's profiler and
returns a :class:`StepTimeline`: the bytes of parameters, gradients, optimizer state,
activations and temporaries allocated at every instant of the step, the phases, and every
collective (kind, payload bytes, start and end) on the same time axis. It can write the
profiler's Chrome trace, which Perfetto (https://ui.perfetto.dev) opens.

:func:`record_units` follows an FSDP2 model's units instead: which of them hold their full
parameters at each collective of a step, and which unit each all-gather and reduce-scatter
serves; its :class:`UnitTimeline` draws them (lesson 04).
"""

from __future__ import annotations

from fsdp_guide.timeline._record import (
    CATEGORIES,
    PHASES,
    CollectiveEvent,
    StepTimeline,
    record_step,
)
from fsdp_guide.timeline._units import UnitEvent, UnitTimeline, record_units

__all__ = [
    "CATEGORIES",
    "PHASES",
    "CollectiveEvent",
    "StepTimeline",
    "UnitEvent",
    "UnitTimeline",
    "record_step",
    "record_units",
]
