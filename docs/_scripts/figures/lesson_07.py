"""Lesson 07: the layers between a LightningModule and the ranks, and what each rank holds."""

from __future__ import annotations

from matplotlib.figure import Figure
from shapes import LABEL, arrow, box, canvas, label
from style import COLORS

LAYER = "#EEF4FA"  # a pale card for each layer of the stack


def strategy_stack() -> Figure:
    figure, axes = canvas(6.0, 7.0)
    layers = [
        ("Your LightningModule", "training_step, configure_optimizers: unchanged"),
        ('pl.Trainer(strategy="ddp_sharded_notebook")', "the loop: batches, steps, checkpoints"),
        ("DDPShardedStrategy", "model → ShardedDataParallel, optimizer → OSS"),
        ("Launcher and process group", "forks a rank per device; gloo on CPUs, NCCL on GPUs"),
    ]
    top, height, gap = 6.9, 0.78, 0.2
    for i, (name, does) in enumerate(layers):
        y = top - (i + 1) * height - i * gap
        box(axes, 0.1, y, 5.8, height, LAYER)
        label(axes, 0.25, y + height * 0.68, name, size=LABEL, weight="bold")
        label(axes, 0.25, y + height * 0.28, does)
        if i:
            arrow(axes, (3.0, y + height + gap), (3.0, y + height))
    # Two ranks under the stack: each holds the whole model, its half of the gradients and of
    # AdamW's state.
    y = top - 4 * (height + gap) + gap
    arrow(axes, (1.5, y), (1.5, y - 0.35))
    arrow(axes, (4.5, y), (4.5, y - 0.35))
    for r, x in enumerate((0.1, 3.1)):
        base = y - 0.35 - 1.95
        box(axes, x, base, 2.8, 1.95, "white")
        label(axes, x + 0.15, base + 1.7, f"rank {r}", size=LABEL, weight="bold")
        box(axes, x + 0.15, base + 1.1, 2.5, 0.34, COLORS["parameters"], "parameters",
            text_color="white")  # fmt: skip
        # The half this rank owns (OSS deals whole tensors out, about half each); the dashed
        # outline is the other rank's half.
        own = (x + 0.15, x + 1.4)[r]
        for level, color, name in (
            (0.62, "gradients", "gradients ½"),
            (0.14, "optimizer", "AdamW ½"),
        ):
            box(axes, x + 0.15, base + level, 2.5, 0.34, "white", linestyle="--")
            box(axes, own, base + level, 1.25, 0.34, COLORS[color], name)
    for level in (0.79, 1.27):  # what crosses between the ranks each step
        arrow(axes, (2.75, base + level), (3.25, base + level), COLORS["communication"], both=True)
    label(axes, 0.1, 0.5, "ShardedDataParallel reduces each gradient to the rank that owns it;")
    label(axes, 0.1, 0.2, "OSS steps the owned half, then broadcasts the new parameters.")
    return figure


FIGURES = {"07_strategy_stack.svg": strategy_stack}
