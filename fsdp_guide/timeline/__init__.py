"""One training step in time: each rank's bytes by category, and its collectives.

:func:`record_step` runs a forward, backward and optimizer step under torch's profiler and
returns a :class:`StepTimeline`: the bytes of parameters, gradients, optimizer state,
activations and temporaries allocated at every instant of the step, the phases, and every
collective (kind, payload bytes, start and end) on the same time axis. It can write the
profiler's Chrome trace, which Perfetto (https://ui.perfetto.dev) opens. :func:`plot_step`
draws a recorded step.
"""

from __future__ import annotations

from fsdp_guide.timeline._plot import plot_step
from fsdp_guide.timeline._record import (
    CATEGORIES,
    PHASES,
    CollectiveEvent,
    StepTimeline,
    record_step,
)

__all__ = ["CATEGORIES", "PHASES", "CollectiveEvent", "StepTimeline", "plot_step", "record_step"]
