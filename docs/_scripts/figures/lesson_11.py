"""Lesson 11's figure: what each rank holds while a model is built whole and then sharded,
against built on the meta device, sharded, allocated with ``to_empty`` and then filled."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

RANKS = 2
WIDTH = 1.0  # the whole model; a rank's shard is WIDTH / RANKS
ROW = 0.36  # height of a rank's bar
GAP = 0.1  # between the two rank bars
STEP = 1.45  # from one stage to the next


def _bars(ax: Axes, x: float, top: float, kind: str) -> None:
    """The rank bars of one stage: ``kind`` is whole, shard, meta-whole, meta-shard or empty."""
    for rank in range(RANKS):
        y = top - (rank + 1) * ROW - rank * GAP
        whole = kind in ("whole", "meta-whole")
        width = WIDTH if whole else WIDTH / RANKS
        left = x if whole else x + rank * WIDTH / RANKS
        # The outline of the whole model, so a shard shows where it sits in it.
        ax.add_patch(Rectangle((x, y), WIDTH, ROW, fill=False, ec="#999999", lw=0.8, ls=":"))
        if kind.startswith("meta"):
            patch = Rectangle(
                (left, y), width, ROW, fill=False, ec=COLORS["parameters"], lw=1.6, ls="--"
            )
        elif kind == "empty":
            patch = Rectangle((left, y), width, ROW, fc="white", ec="#888888", hatch="xxx", lw=1)
        else:
            patch = Rectangle((left, y), width, ROW, color=COLORS["parameters"])
        ax.add_patch(patch)
        if x == 0:
            ax.text(-0.08, y + ROW / 2, f"rank {rank}", ha="right", va="center")


def _lane(ax: Axes, top: float, title: str, stages: list[tuple[str, str]], peak: str) -> None:
    ax.text(-0.75, top, title, fontsize=13, fontweight="bold", va="top")
    labels = top - 0.42
    bars = labels - 0.1
    for i, (kind, label) in enumerate(stages):
        x = i * STEP
        ax.text(x + WIDTH / 2, labels, label, ha="center", va="bottom", fontsize=12)
        _bars(ax, x, bars, kind)
        if i:
            y = bars - ROW - GAP / 2
            arrow = FancyArrowPatch(
                (x - STEP + WIDTH + 0.06, y),
                (x - 0.06, y),
                arrowstyle="-|>",
                mutation_scale=12,
                color=COLORS["text"],
                lw=1.0,
            )
            ax.add_patch(arrow)
    ax.text(
        -0.75,
        bars - 2 * ROW - GAP - 0.12,
        peak,
        va="top",
        fontsize=12,
        color=COLORS["communication"],
    )


def meta_to_shards() -> Figure:
    figure = new_figure(6.0, 4.7)
    ax = figure.add_axes((0, 0, 1, 1))
    _lane(
        ax,
        4.0,
        "Build whole, then shard",
        [("whole", "build()"), ("shard", "fully_shard")],
        "peak: the whole model, on every rank",
    )
    _lane(
        ax,
        2.15,
        "Build on meta, then fill the shards",
        [
            ("meta-whole", "on meta"),
            ("meta-shard", "fully_shard"),
            ("empty", "to_empty"),
            ("shard", "init/load"),
        ],
        "peak: one shard per rank",
    )
    handles = [
        Rectangle((0, 0), 1, 1, color=COLORS["parameters"]),
        Rectangle((0, 0), 1, 1, fill=False, ec=COLORS["parameters"], ls="--", lw=1.6),
        Rectangle((0, 0), 1, 1, fc="white", ec="#888888", hatch="xxx"),
    ]
    ax.legend(
        handles,
        ["weights in memory", "a shape, no memory", "memory, not initialised"],
        loc="lower left",
        bbox_to_anchor=(0.0, 0.0),
        ncol=2,
        frameon=False,
        fontsize=11.5,
        handlelength=1.6,
        columnspacing=1.0,
    )
    ax.set_xlim(-0.8, 3 * STEP + WIDTH + 0.05)
    ax.set_ylim(-0.55, 4.05)
    ax.axis("off")
    return figure


FIGURES = {"11_meta_to_shards.svg": meta_to_shards}
