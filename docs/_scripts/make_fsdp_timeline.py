"""Draw ``notebooks/figures/fsdp_unit_timeline.svg``: one training step of FSDP, unit by unit.

Run from the repository root after changing the figure (the SVG is committed)::

    python docs/_scripts/make_fsdp_timeline.py

Lesson 04 shows it (``figures/fsdp_unit_timeline.svg`` from the notebook; the site copies
``notebooks/figures/`` beside its copy of the lessons). A model of three FSDP units (the root,
then two blocks) with ``FULL_SHARD``. Each unit's full parameters exist only between its
all-gather and the moment it is freed; the communication lane runs ahead of the compute lane
(prefetching), so the next unit's all-gather overlaps the current unit's compute. The root
unit is not freed after forward (its parameters are needed again at the end of backward).

Forward and backward are drawn one above the other, so the figure is narrow enough for its
labels to stay readable at the width of a lesson page, and on a phone. Text is kept as text
in the SVG (not paths): it stays sharp, can be searched, and a test reads its size.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

OUT = Path(__file__).resolve().parents[2] / "notebooks" / "figures" / "fsdp_unit_timeline.svg"
COLORS = {"all-gather": "#2f6699", "compute": "#3d7f2f", "reduce-scatter": "#b85a12"}
# (phase, lane, start, length, kind, label); time in arbitrary units from the phase's start.
EVENTS = (
    ("forward", "comm", 0.0, 1.4, "all-gather", "root"),
    ("forward", "comm", 1.4, 1.4, "all-gather", "block 0"),
    ("forward", "comm", 3.8, 1.4, "all-gather", "block 1"),
    ("forward", "compute", 1.4, 2.4, "compute", "root\n(kept)"),
    ("forward", "compute", 3.8, 2.4, "compute", "block 0\nthen free"),
    ("forward", "compute", 6.2, 2.4, "compute", "block 1\nthen free"),
    ("backward", "comm", 0.0, 1.4, "all-gather", "block 1"),
    ("backward", "compute", 1.4, 2.8, "compute", "block 1\nthen free"),
    ("backward", "comm", 1.4, 1.4, "all-gather", "block 0"),
    ("backward", "comm", 4.2, 1.4, "reduce-scatter", "block 1"),
    ("backward", "compute", 4.2, 2.8, "compute", "block 0\nthen free"),
    ("backward", "comm", 7.0, 1.4, "reduce-scatter", "block 0"),
    ("backward", "compute", 7.0, 2.8, "compute", "root"),
    ("backward", "comm", 9.8, 1.4, "reduce-scatter", "root"),
)
LANES = {"comm": 1.0, "compute": 0.0}
FONT = 13  # points; the SVG is about 500 pt wide, so labels stay above 11 px on a lesson page


def main() -> None:
    plt.rcParams["svg.fonttype"] = "none"
    fig, axes = plt.subplots(2, 1, figsize=(7.0, 4.6), sharex=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for when, lane, start, length, kind, label in EVENTS:
            if when != phase:
                continue
            y = LANES[lane]
            box = Rectangle((start, y + 0.06), length, 0.88, facecolor=COLORS[kind])
            box.set(edgecolor="white", linewidth=2)  # adjacent boxes stay apart
            ax.add_patch(box)
            size = FONT - 1 if "\n" in label else FONT
            ax.text(start + length / 2, y + 0.5, label, ha="center", va="center",
                    fontsize=size, color="white", linespacing=1.0)  # fmt: skip
        ax.set_title(phase, loc="left", fontsize=FONT + 1)
        ax.set_xlim(0, 11.3)
        ax.set_ylim(0, 2)
        ax.set_yticks([0.5, 1.5], ["compute", "comm."], fontsize=FONT)
        ax.tick_params(axis="y", length=0)
        ax.set_xticks([])
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlabel("time →", fontsize=FONT)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="lower center", ncol=3, frameon=False,
               fontsize=FONT, bbox_to_anchor=(0.5, -0.04))  # fmt: skip
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
