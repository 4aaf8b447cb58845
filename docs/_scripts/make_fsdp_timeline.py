"""Draw ``docs/_static/fsdp_unit_timeline.svg``: one training step of FSDP, unit by unit.

Run from the repository root after changing the figure (the SVG is committed)::

    python docs/_scripts/make_fsdp_timeline.py

A model of three FSDP units (the root, then two blocks) with ``FULL_SHARD``. Each unit's full
parameters exist only between its all-gather and the moment it is freed; the communication
lane runs ahead of the compute lane (prefetching), so the next unit's all-gather overlaps the
current unit's compute. The root unit is not freed after forward (its parameters are needed
again at the end of backward, and gathering them twice would cost more than keeping them).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

OUT = Path(__file__).resolve().parents[1] / "_static" / "fsdp_unit_timeline.svg"
COLORS = {"all-gather": "#3b75af", "compute": "#519e3e", "reduce-scatter": "#ef8636"}
# (lane, start, length, kind, label); time in arbitrary units.
EVENTS = (
    ("communication", 0.0, 1.0, "all-gather", "root"),
    ("communication", 1.0, 1.0, "all-gather", "block 0"),
    ("communication", 3.0, 1.0, "all-gather", "block 1"),
    ("compute", 1.0, 2.0, "compute", "fwd root\n(kept)"),
    ("compute", 3.0, 2.0, "compute", "fwd block 0\nthen free"),
    ("compute", 5.0, 2.0, "compute", "fwd block 1\nthen free"),
    ("communication", 7.0, 1.0, "all-gather", "block 1"),
    ("compute", 8.0, 2.5, "compute", "bwd block 1\nthen free"),
    ("communication", 8.0, 1.0, "all-gather", "block 0"),
    ("communication", 10.5, 1.0, "reduce-scatter", "block 1"),
    ("compute", 10.5, 2.5, "compute", "bwd block 0\nthen free"),
    ("communication", 13.0, 1.0, "reduce-scatter", "block 0"),
    ("compute", 13.0, 2.5, "compute", "bwd root"),
    ("communication", 15.5, 1.0, "reduce-scatter", "root"),
)
LANES = {"communication": 1.0, "compute": 0.0}


def main() -> None:
    fig, ax = plt.subplots(figsize=(9.0, 2.6))
    for lane, start, length, kind, label in EVENTS:
        y = LANES[lane]
        ax.add_patch(Rectangle((start, y + 0.1), length, 0.8, color=COLORS[kind], alpha=0.85))
        ax.text(start + length / 2, y + 0.5, label, ha="center", va="center", fontsize=8,
                color="white")  # fmt: skip
    ax.axvline(7.0, color="#555555", linestyle="--", linewidth=1)
    ax.text(3.5, 2.1, "forward", ha="center", fontsize=10)
    ax.text(11.75, 2.1, "backward", ha="center", fontsize=10)
    ax.set_xlim(0, 16.7)
    ax.set_ylim(0, 2.4)
    ax.set_yticks([0.5, 1.5], ["compute", "communication"], fontsize=10)
    ax.set_xticks([])
    ax.set_xlabel("time →", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3,
              frameon=False, fontsize=9)  # fmt: skip
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(OUT, format="svg", bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
