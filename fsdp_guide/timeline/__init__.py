"""One training step in time: each rank's bytes by category, and its collectives.

:func:`record_step` runs a forward, backward and optimizer step under torch's profiler and
returns its timeline: the bytes of parameters, gradients, optimizer state,
activations and temporaries allocated at every instant of the step, the phases, and every
collective (kind, payload bytes, start and end) on the same time axis. It can write the
profiler's Chrome trace, which Perfetto (https://ui.perfetto.dev) opens.

:func:`record_units` follows an FSDP2 model's units instead: which of them hold their full
parameters at each collective of a step, and which unit each all-gather and reduce-scatter
serves; the timeline it returns draws them.
"""

from __future__ import annotations

from fsdp_guide.timeline._record import CATEGORIES, record_step
from fsdp_guide.timeline._record import PHASES as PHASES
from fsdp_guide.timeline._record import CollectiveEvent as CollectiveEvent
from fsdp_guide.timeline._record import StepTimeline as StepTimeline
from fsdp_guide.timeline._units import UnitEvent as UnitEvent
from fsdp_guide.timeline._units import UnitTimeline as UnitTimeline
from fsdp_guide.timeline._units import record_units

__all__ = [
    "CATEGORIES",
    "record_step",
    "record_units",
]
