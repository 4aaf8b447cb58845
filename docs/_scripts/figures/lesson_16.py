"""Lesson 16's figures: pipeline schedules as rank x time grids, drawn from the schedules' own
action lists (``fsdp_guide.memory.pipeline_schedule``, read from torch.distributed.pipelining)
and placed where their inputs exist, a backward costing two forwards.

GPipe against 1F1B on 4 ranks and 6 micro-batches: the same bubble, but GPipe's ranks hold
all 6 micro-batches' activations at once where 1F1B's rank ``r`` holds at most ``4 - r``.
Then what the other schedules do with the same idle time on 2 ranks: interleaved stages (each
rank two stages, the bubble halved) and ZBV (the backward split into its input and weight
halves, the weight halves filling the gaps)."""

from __future__ import annotations

from matplotlib.figure import Figure
from style import COLORS, new_figure

from fsdp_guide.memory import pipeline_schedule
from fsdp_guide.parallel import plot_schedule

LABEL = 11.5  # points: legible once a 6-inch figure is shrunk to a phone's page


def _panel(ax, name: str, ranks: int, microbatches: int, title: str, labels: bool) -> None:
    schedule = pipeline_schedule(name, ranks=ranks, microbatches=microbatches)
    plot_schedule(schedule.timeline(), ax)
    ax.set_title(title, fontsize=LABEL + 0.5, loc="left")
    ax.set_xlabel("")
    ax.set_xticks([])
    for text in list(ax.texts):  # the micro-batch of each box, where there is room for it
        if labels:
            text.set_fontsize(LABEL - 1)
        else:
            text.remove()
    for label in ax.get_yticklabels():
        label.set_fontsize(LABEL)
    legend = ax.get_legend()
    if legend is not None:
        legend.remove()
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    # What each rank holds at its fullest: micro-batches in flight on its stages.
    for rank in range(ranks):
        most = max(sum(f.values()) for f in schedule.in_flight(rank))
        ax.text(
            ax.get_xlim()[1] * 1.01,
            ranks - 0.5 - rank,
            f"holds {most}",
            va="center",
            fontsize=LABEL - 1,
            color=COLORS["activations"],
        )


def _legend(figure: Figure, kinds: tuple[str, ...], columns: int) -> None:
    from matplotlib.patches import Patch

    from fsdp_guide.parallel._pipeline_plot import KIND_COLORS, KIND_NAMES

    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor=COLORS["idle"], label="idle (bubble)"))
    figure.legend(
        handles=handles,
        loc="lower center",
        ncol=columns,
        fontsize=LABEL - 1,
        frameon=False,
        handlelength=1.2,
        columnspacing=1.0,
    )


def gpipe_1f1b() -> Figure:
    figure = new_figure(6.0, 5.4)
    top = figure.add_axes((0.14, 0.56, 0.74, 0.36))
    bottom = figure.add_axes((0.14, 0.12, 0.74, 0.36))
    _panel(top, "GPipe", 4, 6, "GPipe: every forward, then every backward", True)
    _panel(bottom, "1F1B", 4, 6, "1F1B: one forward, one backward", True)
    _legend(figure, ("F", "B"), 3)
    return figure


def interleaved_zero_bubble() -> Figure:
    figure = new_figure(6.0, 4.6)
    top = figure.add_axes((0.14, 0.64, 0.74, 0.26))
    middle = figure.add_axes((0.14, 0.22, 0.74, 0.26))
    _panel(top, "Interleaved1F1B", 2, 4, "Interleaved 1F1B: 2 stages a rank", False)
    _panel(middle, "ZBVZeroBubble", 2, 4, "ZBV: backward split, weights later", False)
    _legend(figure, ("F", "B", "I", "W"), 3)
    return figure


FIGURES = {
    "16_gpipe_1f1b.svg": gpipe_1f1b,
    "16_interleaved_zero_bubble.svg": interleaved_zero_bubble,
}
