"""Lesson 10: one FSDP unit through a step, and the FSDPStrategy knob that acts at each point."""

from __future__ import annotations

from matplotlib.figure import Figure
from shapes import arrow, box, canvas, label
from style import COLORS

# (what happens to the unit, its colour, white text?, the knob, what the knob does there)
FLOW = (
    ("a Block: one unit", "white", False, "auto_wrap_policy={Block}", "which modules are units"),
    ("its shard, 1/N", "parameters", True, "cpu_offload", "the shard lives on the host"),
    (
        "all-gather the full unit",
        "communication",
        True,
        "precision / mixed_precision",
        "gather in bf16 or fp32",
    ),
    ("forward", "compute", False, "activation_checkpointing_policy", "keep its input, recompute"),
    ("free the gathered copy", "idle", False, "sharding_strategy", "free now, or after backward"),
    (
        "backward, reduce-scatter",
        "communication",
        True,
        "mixed_precision",
        "reduce in bf16 or fp32",
    ),
    ("Adam steps the shard", "optimizer", True, "use_orig_params", "tensors, or one flat shard"),
    ("save", "white", False, "state_dict_type", "one full file, or a file per rank"),
)


def strategy_knobs() -> Figure:
    figure, axes = canvas(6.0, 7.3)
    label(axes, 0.05, 7.05, "One unit through a step, and the FSDPStrategy knob at each point")
    step, height = 0.84, 0.5
    for row, (what, color, white, knob, does) in enumerate(FLOW):
        y = 6.25 - row * step
        fill = color if color == "white" else COLORS[color]
        text = "white" if white else COLORS["text"]
        box(axes, 0.1, y, 2.45, height, fill, what, text_color=text)
        if row:
            arrow(axes, (1.325, y + step), (1.325, y + height))
        axes.plot([2.55, 2.8], [y + height / 2] * 2, color=COLORS["text"], lw=1, ls=":")
        label(axes, 2.85, y + 0.37, knob, family="monospace")
        label(axes, 2.85, y + 0.11, does)
    return figure


FIGURES = {"10_strategy_knobs.svg": strategy_knobs}
