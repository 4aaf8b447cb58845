"""Lesson 12's figures: a full checkpoint against a sharded one, and how a sharded
checkpoint saved on 2 ranks is read back by 3."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

WIDTH = 1.2  # the whole training state (parameters and Adam's moments)
ROW = 0.34
STATE = COLORS["optimizer"]
FILE = "#F7F7F7"


def _shard(ax: Axes, x: float, y: float, rank: int, ranks: int = 2, label: bool = True) -> None:
    """A rank's bar: the outline of the whole state, its own part filled."""
    ax.add_patch(Rectangle((x, y), WIDTH, ROW, fill=False, ec="#999999", lw=0.8, ls=":"))
    part = WIDTH / ranks
    ax.add_patch(Rectangle((x + rank * part, y), part, ROW, color=STATE))
    if label:
        ax.text(x - 0.08, y + ROW / 2, f"rank {rank}", ha="right", va="center")


def _file(ax: Axes, x: float, y: float, w: float, name: str, note: str) -> None:
    ax.add_patch(Rectangle((x, y), w, ROW + 0.1, fc=FILE, ec=COLORS["text"], lw=1))
    ax.text(x + 0.08, y + (ROW + 0.1) / 2, name, va="center", fontsize=11.5, family="monospace")
    ax.text(x + w + 0.08, y + (ROW + 0.1) / 2, note, va="center", fontsize=11.5)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], **kw: object) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=11,
            color=COLORS["text"],
            lw=1.0,
            shrinkA=2,
            shrinkB=2,
            **kw,
        )
    )


def full_vs_sharded() -> Figure:
    figure = new_figure(6.0, 4.9)
    ax = figure.add_axes((0, 0, 1, 1))
    # Full: every rank sends its part to rank 0, which holds the whole state and writes it.
    ax.text(-0.75, 4.3, "Full: gathered, one file", fontsize=13, fontweight="bold", va="top")
    for rank in range(2):
        _shard(ax, 0, 3.35 - rank * 0.5, rank)
    ax.add_patch(Rectangle((1.95, 3.1), WIDTH, ROW, color=STATE))
    ax.text(
        1.95 + WIDTH / 2,
        3.1 + ROW + 0.06,
        "rank 0 holds all",
        ha="center",
        va="bottom",
        fontsize=11.5,
        color=COLORS["communication"],
    )
    _arrow(ax, (WIDTH, 3.35 + ROW / 2), (1.95, 3.1 + ROW * 0.7))
    _arrow(ax, (WIDTH, 2.85 + ROW / 2), (1.95, 3.1 + ROW * 0.3))
    _file(ax, 1.95, 2.3, 1.2, "full.pt", "12Ψ bytes")
    _arrow(ax, (1.95 + WIDTH / 2, 3.1), (1.95 + WIDTH / 2, 2.3 + ROW + 0.1))
    # Sharded: every rank writes its own part, rank 0 also the index of the pieces.
    ax.text(-0.75, 1.85, "Sharded: each rank its part", fontsize=13, fontweight="bold", va="top")
    for rank in range(2):
        y = 0.9 - rank * 0.55
        _shard(ax, 0, y, rank)
        _file(ax, 1.95, y - 0.05, 1.7, f"__{rank}_0.distcp", "12Ψ/N")
        _arrow(ax, (WIDTH, y + ROW / 2), (1.95, y + ROW / 2))
    _file(ax, 1.95, -0.55, 1.7, ".metadata", "what is where")
    ax.text(1.95 - 0.1, -0.55 + (ROW + 0.1) / 2, "rank 0", ha="right", va="center")
    ax.set_xlim(-0.8, 5.25)
    ax.set_ylim(-0.65, 4.35)
    ax.axis("off")
    return figure


def resharding() -> Figure:
    figure = new_figure(6.0, 3.5)
    ax = figure.add_axes((0, 0, 1, 1))
    rows, saved, loaded = 512, 2, 3
    scale = 4.2 / rows  # x units per row
    shades = ("#8FD3BF", STATE)  # the two files
    ax.text(-0.1, 3.05, "one weight of 512 rows, saved on 2 ranks", fontsize=12, va="bottom")
    for i in range(saved):
        a, b = i * rows // saved, (i + 1) * rows // saved
        ax.add_patch(Rectangle((a * scale, 2.5), (b - a) * scale, ROW + 0.1, color=shades[i]))
        ax.text(
            (a + b) / 2 * scale,
            2.5 + (ROW + 0.1) / 2,
            f"__{i}_0.distcp",
            ha="center",
            va="center",
            fontsize=11.5,
            family="monospace",
        )
        ax.text(
            (a + b) / 2 * scale, 2.45, f"rows {a}-{b - 1}", ha="center", va="top", fontsize=11.5
        )
    ax.text(-0.1, 1.85, "loaded on 3 ranks: each reads its rows", fontsize=12, va="bottom")
    size = -(-rows // loaded)  # FSDP2 cuts dimension 0 as torch.chunk does: 171, 171, 170
    cuts = [0, 256, rows]
    for rank in range(loaded):
        a, b = rank * size, min((rank + 1) * size, rows)
        y = 1.3 - rank * 0.5
        for i in range(saved):  # the overlap of this rank's rows with each file
            lo, hi = max(a, cuts[i]), min(b, cuts[i + 1])
            if lo < hi:
                ax.add_patch(Rectangle((lo * scale, y), (hi - lo) * scale, ROW, color=shades[i]))
        ax.add_patch(
            Rectangle((a * scale, y), (b - a) * scale, ROW, fill=False, ec=COLORS["text"], lw=1)
        )
        ax.text(-0.1, y + ROW / 2, f"rank {rank}", ha="right", va="center")
        ax.text(
            (a + b) / 2 * scale,
            y + ROW / 2,
            f"rows {a}-{b - 1}",
            ha="center",
            va="center",
            fontsize=11.5,
        )
    ax.set_xlim(-0.85, 4.35)
    ax.set_ylim(-0.1, 3.5)
    ax.axis("off")
    return figure


FIGURES = {
    "12_full_vs_sharded.svg": full_vs_sharded,
    "12_resharding.svg": resharding,
}
