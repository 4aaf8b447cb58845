"""A recorded step drawn: bytes by category over the step, its collectives below (private).

matplotlib is imported when a step is drawn, not before.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

from fsdp_guide.timeline._record import CATEGORIES, StepTimeline

#: One colour per category, those of the lessons' figures (Okabe-Ito: colour-blind safe).
COLORS = {
    "params": "#0072B2",
    "grads": "#E69F00",
    "optimizer": "#009E73",
    "activations": "#CC79A7",
    "temporaries": "#999999",
}
_LANES = {"all_gather": 1.0, "reduce_scatter": 0.0}
# The optimizer step allocates Adam's small temporaries tensor by tensor, hundreds of events
# that would take most of the axis while the bytes barely move: the plot shows its start.
_STEP_EVENTS = 80


def plot_step(
    timeline: StepTimeline, title: str = "", path: str | os.PathLike[str] | None = None
) -> Any:
    """Draw one recorded step: the bytes of each category stacked over the step, the phases
    shaded, the peak marked, and every collective on the same axis underneath.

    The axis counts the allocator's events in order rather than microseconds: on CPU ranks
    most of a step's wall time is a rank waiting for its peer inside a collective, which
    would squeeze everything else into a corner (``timeline.times_us`` keeps the times).

    Args:
        timeline: What :func:`record_step` returned.
        title: Drawn above the plot.
        path: Where to write a PNG; ``None`` to only return the figure.

    Returns:
        The matplotlib ``Figure``.

    Examples:
        >>> import os, tempfile
        >>> from fsdp_guide.timeline import CollectiveEvent
        >>> phases = (("forward", 0.0, 1.0), ("backward", 1.0, 2.0), ("optimizer step", 2.0, 3.0))
        >>> gather = CollectiveEvent(kind="all_gather", bytes=8, start_us=0.5, end_us=1.0)
        >>> step = StepTimeline(
        ...     times_us=(0.0, 1.0, 2.0, 3.0),
        ...     bytes={c: (4, 8, 6, 4) for c in CATEGORIES},
        ...     phases=phases,
        ...     collectives=(gather,),
        ...     state_before=12,
        ... )
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     figure = plot_step(step, "a step", os.path.join(tmp, "step.png"))
        ...     os.path.getsize(os.path.join(tmp, "step.png")) > 0
        True
    """
    import matplotlib

    if path is not None and "ipykernel" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, lane) = plt.subplots(
        2, 1, figsize=(8.0, 5.2), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    times = timeline.times_us

    def at(time_us: float) -> int:
        return bisect.bisect_left(times, time_us)

    mib = 2**20
    xs = range(len(times))
    top.stackplot(
        xs,
        *[[b / mib for b in timeline.bytes[c]] for c in CATEGORIES],
        labels=list(CATEGORIES),
        colors=[COLORS[c] for c in CATEGORIES],
    )
    peak = timeline.peak / mib
    top.axvline(timeline.peak_index, color="black", linewidth=1)
    top.annotate(
        f"peak {peak:.2f} MiB",
        (timeline.peak_index, peak),
        xytext=(10, 4),
        textcoords="offset points",
        fontsize=11,
    )
    step_start = next((at(a) for n, a, _ in timeline.phases if n == "optimizer step"), len(xs))
    shown = min(len(xs), max(step_start + _STEP_EVENTS, timeline.peak_index + 20))
    for name, start, end in timeline.phases:
        first, last = at(start), min(at(end), shown)
        if name != "optimizer step":
            top.axvspan(first, last, alpha=0.06, color="black")
        top.text((first + last) / 2, peak * 1.27, name, ha="center", va="top", fontsize=11)
    top.set_ylabel("MiB allocated", fontsize=11)
    top.set_ylim(0, peak * 1.32)
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=10, ncol=5, frameon=False)
    if title:
        figure.suptitle(title, fontsize=12)
    for event in timeline.collectives:
        start = at(event.start_us)
        lane.barh(
            _LANES.get(event.kind, 0.5),
            max(at(event.end_us) - start, 3),
            left=start,
            height=0.6,
            color="#D55E00",
        )
    lane.set_xlim(0, shown)
    lane.set_ylim(-0.6, 1.6)
    lane.set_yticks([0, 0.5, 1], ["reduce-scatter", "other", "all-gather"], fontsize=10)
    lane.set_xlabel("the allocator's events, in order", fontsize=11)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=120)
        plt.close(figure)
    return figure
