"""Lesson 01's figure: the collectives, and reduce-scatter + all-gather = all-reduce.

Four ranks each start with a vector of four pieces (rank 0's ``a0 … a3``, rank 1's
``b0 … b3``, ...). An all-reduce leaves the sum ``S = a + b + c + d`` on every rank; a
reduce-scatter leaves rank ``r`` only the piece ``S_r`` of that sum; an all-gather of those
pieces gives every rank all of ``S`` again: the all-reduce's result, in two steps.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

WORLD_SIZE = 4
LETTERS = "abcd"
CELL = 0.62  # width of one piece
FONT = 11.5


def _vector(ax: Axes, x: float, y: float, labels: list[str], filled: list[bool]) -> None:
    """One rank's vector of pieces: a filled piece holds a sum, an open one the rank's own."""
    for piece, (label, full) in enumerate(zip(labels, filled, strict=True)):
        if not label:
            box = Rectangle((x + piece * CELL, y + 0.12), CELL, 0.76, facecolor="white",
                            edgecolor=COLORS["idle"], linestyle=":", lw=1.0)  # fmt: skip
        elif full:
            box = Rectangle((x + piece * CELL, y + 0.12), CELL, 0.76, facecolor=COLORS["gradients"],
                            edgecolor="white", lw=1.5)  # fmt: skip
        else:
            box = Rectangle((x + piece * CELL, y + 0.12), CELL, 0.76, facecolor="white",
                            edgecolor=COLORS["gradients"], lw=1.2)  # fmt: skip
        ax.add_patch(box)
        if label:
            ax.text(x + (piece + 0.5) * CELL, y + 0.5, label, ha="center", va="center",
                    fontsize=FONT, color=COLORS["text"])  # fmt: skip


def _panel(ax: Axes, title: str, before: list[list[str]], after: list[list[str]]) -> None:
    left, right = 0.0, WORLD_SIZE * CELL + 1.1
    for rank in range(WORLD_SIZE):
        y = WORLD_SIZE - 1 - rank
        ax.text(-0.15, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=FONT)
        _vector(ax, left, y, before[rank], [label.startswith("S") for label in before[rank]])
        _vector(ax, right, y, after[rank], [label.startswith("S") for label in after[rank]])
    middle = WORLD_SIZE / 2
    ax.add_patch(
        FancyArrowPatch((WORLD_SIZE * CELL + 0.15, middle), (right - 0.15, middle),
                        arrowstyle="-|>", mutation_scale=18, color=COLORS["text"])
    )  # fmt: skip
    ax.set_title(title, loc="left", fontsize=FONT + 1)
    ax.set_xlim(-1.5, right + WORLD_SIZE * CELL + 0.1)
    ax.set_ylim(0, WORLD_SIZE)
    ax.axis("off")


def collectives() -> Figure:
    """All-reduce; reduce-scatter, then all-gather of its pieces: the same result."""
    own = [[f"{LETTERS[r]}{p}" for p in range(WORLD_SIZE)] for r in range(WORLD_SIZE)]
    total = [f"S{p}" for p in range(WORLD_SIZE)]
    mine = [[f"S{p}" if p == r else "" for p in range(WORLD_SIZE)] for r in range(WORLD_SIZE)]
    figure = new_figure(6.0, 7.4)
    axes = figure.subplots(3, 1)
    _panel(axes[0], "all-reduce: every rank gets the sum S", own, [total] * WORLD_SIZE)
    _panel(axes[1], "reduce-scatter: rank r gets the piece S_r", own, mine)
    _panel(axes[2], "all-gather: every rank gets every piece", mine, [total] * WORLD_SIZE)
    figure.text(
        0.5,
        0.015,
        "S = a + b + c + d, piece by piece.\nReduce-scatter, then all-gather = all-reduce.",
        ha="center",
        va="bottom",
        fontsize=FONT + 0.5,
    )
    figure.tight_layout(rect=(0, 0.07, 1, 1), h_pad=1.2)
    return figure


FIGURES = {"01_collectives.svg": collectives}
