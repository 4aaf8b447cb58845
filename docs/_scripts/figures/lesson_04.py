"""Lesson 04's figure: one training step of FSDP, unit by unit.

A model of three FSDP units (the root, then two blocks). A unit's full parameters exist only
between its all-gather and the moment it is freed; the communication lane runs ahead of the
compute lane (prefetching), so the next unit's all-gather overlaps the current unit's
compute. The root unit is not freed after forward: its parameters are needed again first
thing in backward. Forward and backward are drawn one above the other, so the figure stays
narrow enough for its labels to read on a phone.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from style import COLORS, new_figure

#: Fill and label colour of each kind of box (the lessons' colours: an all-gather moves
#: parameters, a reduce-scatter gradients).
KINDS = {
    "all-gather": (COLORS["parameters"], "white"),
    "compute": (COLORS["compute"], COLORS["text"]),
    "reduce-scatter": (COLORS["gradients"], COLORS["text"]),
}
# (phase, lane, start, length, kind, label); time in arbitrary units from the phase's start.
EVENTS = (
    ("forward", "comm", 0.0, 1.8, "all-gather", "root"),
    ("forward", "comm", 1.8, 1.8, "all-gather", "block 0"),
    ("forward", "comm", 4.2, 1.8, "all-gather", "block 1"),
    ("forward", "compute", 1.8, 2.4, "compute", "root\n(kept)"),
    ("forward", "compute", 4.2, 2.4, "compute", "block 0\nthen free"),
    ("forward", "compute", 6.6, 2.4, "compute", "block 1\nthen free"),
    ("backward", "comm", 0.0, 1.8, "all-gather", "block 1"),
    ("backward", "compute", 1.8, 2.8, "compute", "block 1\nthen free"),
    ("backward", "comm", 1.8, 1.8, "all-gather", "block 0"),
    ("backward", "comm", 4.6, 1.8, "reduce-scatter", "block 1"),
    ("backward", "compute", 4.6, 2.8, "compute", "block 0\nthen free"),
    ("backward", "comm", 7.4, 1.8, "reduce-scatter", "block 0"),
    ("backward", "compute", 7.4, 2.8, "compute", "root"),
    ("backward", "comm", 10.2, 1.8, "reduce-scatter", "root"),
)
LANES = {"comm": 1.0, "compute": 0.0}
FONT = 12.5


def unit_timeline() -> Figure:
    """Forward above backward: the all-gathers, computes and reduce-scatters of three units."""
    figure = new_figure(6.4, 4.6)
    axes = figure.subplots(2, 1, sharex=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for when, lane, start, length, kind, label in EVENTS:
            if when != phase:
                continue
            fill, ink = KINDS[kind]
            y = LANES[lane]
            box = Rectangle((start, y + 0.06), length, 0.88, facecolor=fill)
            box.set(edgecolor="white", linewidth=2)  # adjacent boxes stay apart
            ax.add_patch(box)
            size = FONT - 1 if "\n" in label else FONT
            ax.text(start + length / 2, y + 0.5, label, ha="center", va="center",
                    fontsize=size, color=ink, linespacing=1.0)  # fmt: skip
        ax.set_title(phase, loc="left", fontsize=FONT + 1)
        ax.set_xlim(0, 12.1)
        ax.set_ylim(0, 2)
        ax.set_yticks([0.5, 1.5], ["compute", "comm."], fontsize=FONT)
        ax.tick_params(axis="y", length=0)
        ax.set_xticks([])
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("time →", fontsize=FONT)
    handles = [Rectangle((0, 0), 1, 1, color=fill) for fill, _ in KINDS.values()]
    figure.legend(handles, list(KINDS), loc="lower center", ncols=3, frameon=False,
                  fontsize=FONT, bbox_to_anchor=(0.5, -0.04))  # fmt: skip
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    return figure


FIGURES = {"04_unit_timeline.svg": unit_timeline}
