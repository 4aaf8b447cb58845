"""Lesson 14's figures: a colwise layer followed by a rowwise one on two ranks (one
all-reduce for the pair), and the groups of a 2 x 2 mesh, for TP with FSDP2 and for HSDP."""

from __future__ import annotations

import itertools

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from style import COLORS, new_figure

BOX = 0.8
ROWS = (0.0, -1.35)  # the two ranks' lanes


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], **kw: object) -> None:
    style = {"arrowstyle": "-|>", "mutation_scale": 11, "color": COLORS["text"], "lw": 1.0}
    ax.add_patch(FancyArrowPatch(start, end, shrinkA=1, shrinkB=1, **{**style, **kw}))


def _tensor(ax: Axes, x: float, y: float, label: str, partial: bool = False) -> None:
    """An activation: ``partial`` for a partial sum that needs the other rank's."""
    if partial:
        patch = Rectangle(
            (x, y), BOX, BOX, fc="white", ec=COLORS["activations"], hatch="///", lw=1.5
        )
    else:
        patch = Rectangle((x, y), BOX, BOX, color=COLORS["activations"])
    ax.add_patch(patch)
    ax.text(
        x + BOX / 2,
        y + BOX / 2,
        label,
        ha="center",
        va="center",
        fontsize=12.5,
        bbox={"fc": "white", "ec": "none", "pad": 1} if partial else None,
    )


def _weight(ax: Axes, x: float, y: float, rank: int, by: str) -> None:
    """A weight matrix: the rank keeps its rows (colwise) or its columns (rowwise)."""
    ax.add_patch(Rectangle((x, y), BOX, BOX, fill=False, ec="#999999", lw=0.8, ls=":"))
    if by == "rows":  # output features: rank 0 the top half
        part = Rectangle((x, y + (1 - rank) * BOX / 2), BOX, BOX / 2, color=COLORS["parameters"])
    else:  # input features: rank 0 the left half
        part = Rectangle((x + rank * BOX / 2, y), BOX / 2, BOX, color=COLORS["parameters"])
    ax.add_patch(part)


def colwise_rowwise() -> Figure:
    figure = new_figure(6.0, 3.9)
    ax = figure.add_axes((0, 0, 1, 1))
    columns = (0.0, 1.25, 2.5, 3.75, 5.0, 6.45)
    heads = ("x", "W1\ncolwise", "h", "W2\nrowwise", "partial\nsums", "z")
    for x, head in zip(columns, heads, strict=True):
        ax.text(x + BOX / 2, 1.0, head, ha="center", va="bottom", fontsize=12)
    for rank, y in enumerate(ROWS):
        ax.text(-0.12, y + BOX / 2, f"rank {rank}", ha="right", va="center")
        _tensor(ax, columns[0], y, "whole")
        _weight(ax, columns[1], y, rank, "rows")
        _tensor(ax, columns[2], y, f"half {rank}")
        _weight(ax, columns[3], y, rank, "columns")
        _tensor(ax, columns[4], y, f"z{rank}", partial=True)
        _tensor(ax, columns[5], y, "z0+z1")
        for a, b in itertools.pairwise(columns[:5]):
            _arrow(ax, (a + BOX, y + BOX / 2), (b, y + BOX / 2))
    # The one message of the pair: the partial sums added across the two ranks.
    middle = (ROWS[0] + ROWS[1] + BOX) / 2
    for y in ROWS:
        _arrow(
            ax,
            (columns[4] + BOX, y + BOX / 2),
            (columns[5], y + BOX / 2),
            color=COLORS["communication"],
            lw=2.0,
        )
    ax.text(
        columns[4] + BOX + 0.32,
        middle,
        "all-\nreduce",
        ha="center",
        va="center",
        fontsize=12,
        color=COLORS["communication"],
    )
    ax.text(
        columns[1] + BOX / 2,
        ROWS[1] - 0.2,
        "keeps half\nthe rows",
        ha="center",
        va="top",
        fontsize=11.5,
    )
    ax.text(
        columns[3] + BOX / 2,
        ROWS[1] - 0.2,
        "keeps half\nthe columns",
        ha="center",
        va="top",
        fontsize=11.5,
    )
    ax.set_xlim(-0.95, 7.35)
    ax.set_ylim(-2.25, 1.75)
    ax.axis("off")
    return figure


def _group(ax: Axes, x: float, y: float, w: float, h: float, color: str, dashed: bool) -> None:
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.06,rounding_size=0.2",
            fill=False,
            ec=color,
            lw=2.2,
            ls="--" if dashed else "-",
        )
    )


def _mesh(ax: Axes, top: float, title: str, across: str, down: str) -> None:
    """A 2 x 2 mesh, rank = 2 * row + column: groups along rows (solid) and columns (dashed)."""
    ax.text(-0.2, top + 0.25, title, fontsize=13, fontweight="bold", va="bottom")
    size, gap = 0.7, 0.5
    for rank in range(4):
        row, column = divmod(rank, 2)
        x, y = column * (size + gap), top - (row + 1) * size - row * gap
        ax.add_patch(Rectangle((x, y), size, size, fc="#F2F2F2", ec=COLORS["text"], lw=1))
        ax.text(x + size / 2, y + size / 2, f"rank\n{rank}", ha="center", va="center", fontsize=12)
    span = 2 * size + gap
    for row in range(2):  # along a row: solid
        y = top - (row + 1) * size - row * gap
        _group(ax, -0.08, y - 0.08, span + 0.16, size + 0.16, COLORS["communication"], False)
    for column in range(2):  # down a column: dashed
        x = column * (size + gap)
        _group(
            ax, x - 0.16, top - span - 0.16, size + 0.32, span + 0.32, COLORS["parameters"], True
        )
    ax.text(
        span + 0.5, top - size / 2, across, va="center", fontsize=12, color=COLORS["communication"]
    )
    ax.text(
        span + 0.5,
        top - span + size / 2,
        down,
        va="center",
        fontsize=12,
        color=COLORS["parameters"],
    )


def mesh_groups() -> Figure:
    figure = new_figure(6.0, 5.3)
    ax = figure.add_axes((0, 0, 1, 1))
    _mesh(
        ax,
        4.85,
        "TP inside, FSDP2 across: mesh (dp, tp)",
        "rows, tp: the same samples;\nall-reduce activations",
        "columns, dp: FSDP2;\nall-gather weights,\nreduce-scatter gradients",
    )
    _mesh(
        ax,
        1.95,
        "HSDP: mesh (replicate, shard)",
        "rows, shard: FSDP2;\nall-gather, reduce-scatter",
        "columns, replicate:\nall-reduce gradient\nshards",
    )
    ax.set_xlim(-0.35, 5.6)
    ax.set_ylim(-0.3, 5.5)
    ax.axis("off")
    return figure


FIGURES = {
    "14_colwise_rowwise.svg": colwise_rowwise,
    "14_mesh_groups.svg": mesh_groups,
}
