"""A pipeline step drawn as a rank x time grid of its actions (private).

matplotlib is imported when a grid is drawn, not before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp_guide.memory import TimedAction

#: One colour per kind of action (Okabe-Ito, as the lessons' figures): forward, full
#: backward, the backward's input half and its weights' half.
KIND_COLORS = {"F": "#56B4E9", "B": "#E69F00", "I": "#F0C36B", "W": "#009E73"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}

Step = Sequence[Sequence[TimedAction | tuple[str, float, float]]]


def plot_schedule(
    step: Step,
    ax: Any = None,
    *,
    title: str = "",
    unit: str = "",
    show_stage: bool | None = None,
    labels: bool = True,
) -> Any:
    """Draw a pipeline step: one row per rank, one box per action from its start to its end.

    Boxes are coloured by kind (forward, backward, or the backward's input and weight
    halves) and labelled with their micro-batch (and their stage when a rank holds several);
    what is left white is the bubble.

    Args:
        step: Per rank, its actions with their times: the simulated
            ``PipelineSchedule.timeline``, or the ``(action, start,
            end)`` records of a run (:func:`~fsdp_guide.parallel.train_pipeline`'s
            ``timeline``, one list per rank), in seconds.
        ax: The matplotlib axes to draw on; a new figure by default.
        title: The axes' title.
        unit: ``"ms"`` to show seconds as milliseconds from the first start; by default the
            times as given, from the first start.
        show_stage: Label boxes with their stage too (default: when a rank holds several).
        labels: Label the boxes at all (many small boxes read better without).

    Returns:
        The axes.

    Examples:
        >>> from fsdp_guide.memory import pipeline_schedule
        >>> steps = pipeline_schedule("1F1B", ranks=2, microbatches=2).timeline()
        >>> len(plot_schedule(steps).patches)  # 4 actions on each rank
        8
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from fsdp_guide.memory import PipelineSchedule

    rows = PipelineSchedule.read(step)
    first = min(t.start for row in rows for t in row)
    scale = 1000.0 if unit == "ms" else 1.0
    stages = {t.action.stage for row in rows for t in row}
    if show_stage is None:
        show_stage = len(stages) > len(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 0.5 + 0.55 * len(rows)))
    kinds = []
    for r, row in enumerate(rows):
        y = len(rows) - 1 - r
        for t in row:
            x0, x1 = (t.start - first) * scale, (t.end - first) * scale
            kind = t.action.kind
            kinds.append(kind)
            ax.add_patch(
                Rectangle(
                    (x0, y + 0.08),
                    x1 - x0,
                    0.84,
                    facecolor=KIND_COLORS[kind],
                    edgecolor="white",
                    linewidth=0.6,
                )
            )
            if labels:
                mb = t.action.microbatch
                label = f"{t.action.stage}:{mb}" if show_stage else str(mb)
                ax.text((x0 + x1) / 2, y + 0.5, label, ha="center", va="center", fontsize=8)
    end = max((t.end - first) * scale for row in rows for t in row)
    ax.set_xlim(0, end)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 0.5 - r for r in range(len(rows))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(rows))])
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    if title:
        ax.set_title(title, fontsize=10)
    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in KIND_COLORS if k in kinds]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    return ax
