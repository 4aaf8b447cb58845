"""Lesson 08: DDP's gradient buckets, all-reduced while backward goes on."""

from __future__ import annotations

from matplotlib.figure import Figure
from shapes import LABEL, arrow, box, canvas, label, legend
from style import COLORS


def buckets_overlap() -> Figure:
    figure, axes = canvas(6.0, 4.6)
    x0, unit = 1.45, 0.37  # where time starts, inches per unit of time
    rows = {"backward": 3.55, "buckets": 2.6, "all-reduce": 1.55}
    for name, y in rows.items():
        label(axes, 0.05, y + 0.25, name, size=LABEL, weight="bold")
    label(axes, 0.05, 4.35, "One backward pass on one rank (the other ranks do the same)")
    # Backward runs from the last layer to the first; each layer's gradients land in a bucket:
    # L4's and L3's in bucket A, L2's and L1's in bucket B.
    for i, name in enumerate(("∇ L4", "∇ L3", "∇ L2", "∇ L1")):
        box(axes, x0 + 2 * i * unit, rows["backward"], 2 * unit, 0.5, COLORS["compute"], name)
    for i, name in enumerate(("bucket A fills", "bucket B fills")):
        box(axes, x0 + 4 * i * unit, rows["buckets"], 4 * unit, 0.5, COLORS["gradients"], name)
    # A full bucket is all-reduced at once, on its own stream, while backward goes on.
    for start, length, name in ((4, 3.2, "all-reduce\nbucket A"), (8, 2.4, "all-reduce\nbucket B")):
        arrow(
            axes,
            (x0 + start * unit, rows["buckets"]),
            (x0 + start * unit, rows["all-reduce"] + 0.6),
        )
        box(
            axes, x0 + start * unit, rows["all-reduce"], length * unit, 0.6,
            COLORS["communication"], name, text_color="white",
        )  # fmt: skip
    box(axes, x0 + 10.4 * unit, rows["backward"], 1.4 * unit, 0.5, COLORS["optimizer"], "step")
    # The overlap: bucket A's all-reduce runs under L2's and L1's backward.
    for t in (4, 7.2):
        axes.plot(
            [x0 + t * unit] * 2, [1.3, 4.1], color=COLORS["text"], linestyle=":", lw=1, zorder=0
        )
    label(axes, x0 + 5.6 * unit, 1.15, "overlapped", ha="center")
    arrow(axes, (x0, 0.8), (x0 + 11.8 * unit, 0.8))
    label(axes, x0 + 11.8 * unit, 0.6, "time", ha="right")
    legend(
        axes,
        0.1,
        0.22,
        [
            (COLORS["compute"], "compute"),
            (COLORS["gradients"], "bucket"),
            (COLORS["communication"], "all-reduce"),
            (COLORS["optimizer"], "optimizer"),
        ],
    )
    return figure


FIGURES = {"08_buckets_overlap.svg": buckets_overlap}
