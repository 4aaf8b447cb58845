"""Lesson 09: what each DeepSpeed ZeRO stage keeps on a rank, and where offload moves it."""

from __future__ import annotations

from matplotlib.figure import Figure
from shapes import LABEL, arrow, box, canvas, label, legend
from style import COLORS

# Bytes per parameter of each kind of state in fp32 with Adam, as DeepSpeed keeps them: the
# model's parameters, its fp32 master copy (a separate partition, even in fp32), the
# gradients, and Adam's two moments.
KINDS = (("parameters", 4), ("master", 4), ("gradients", 4), ("optimizer", 8))
# Which kinds each stage partitions over the ranks (stage 0 keeps no master copy).
STAGES = (
    ("stage 0", set(), False),
    ("stage 1", {"master", "optimizer"}, True),
    ("stage 2", {"master", "optimizer", "gradients"}, True),
    ("stage 3", {"master", "optimizer", "gradients", "parameters"}, True),
)


def zero_stages() -> Figure:
    figure, axes = canvas(6.0, 4.4)
    x0, per_byte = 1.1, 4.75 / 20  # inches per byte of state per parameter
    label(axes, 0.05, 4.2, "What rank 0 of 2 keeps during a step, bytes per parameter")
    for row, (name, sharded, master) in enumerate(STAGES):
        y = 3.4 - row * 0.75
        label(axes, 0.05, y + 0.22, name, size=LABEL, weight="bold")
        x = x0
        for kind, size in KINDS:
            if kind == "master" and not master:
                continue
            width = size * per_byte
            box(axes, x, y, width, 0.44, "white", linestyle="--")
            held = width / 2 if kind in sharded else width
            text = f"{size // 2 if kind in sharded else size}"
            white = kind in ("parameters", "optimizer")
            box(axes, x, y, held, 0.44, COLORS[kind], text, text_color="white" if white else None)
            x += width
    label(axes, 0.05, 0.72, "Dashed: the part rank 1 keeps. After engine.step() stages 0-2")
    label(axes, 0.05, 0.47, "have freed their gradients; stage 3 keeps a gradient buffer.")
    legend(
        axes,
        0.1,
        0.15,
        [
            (COLORS["parameters"], "params"),
            (COLORS["master"], "fp32 master"),
            (COLORS["gradients"], "grads"),
            (COLORS["optimizer"], "Adam"),
        ],
    )
    return figure


def offload_path() -> Figure:
    figure, axes = canvas(6.0, 5.0)
    for x, name in ((0.1, "GPU"), (3.3, "CPU (host memory)")):
        box(axes, x, 1.55, 2.6, 3.1, "white")
        label(axes, x + 0.15, 4.4, name, size=LABEL, weight="bold")
    # On the GPU: the model's parameters and the activations of the step.
    box(axes, 0.3, 3.45, 2.2, 0.5, COLORS["parameters"], "parameters", text_color="white")
    box(axes, 0.3, 2.7, 2.2, 0.5, COLORS["activations"], "activations")
    box(axes, 0.3, 1.95, 2.2, 0.5, COLORS["gradients"], "gradients, in backward")
    # On the host: the rank's partition of everything the optimizer needs, and its step.
    box(axes, 3.5, 3.45, 2.2, 0.5, COLORS["master"], "fp32 master partition")
    box(axes, 3.5, 2.7, 2.2, 0.5, COLORS["optimizer"], "Adam moments", text_color="white")
    box(axes, 3.5, 1.95, 2.2, 0.5, COLORS["gradients"], "gradient partition")
    # Each step: the gradient partition goes to the host, the updated parameters come back.
    arrow(axes, (2.5, 2.2), (3.5, 2.2), COLORS["communication"])
    arrow(axes, (3.5, 3.7), (2.5, 3.7), COLORS["communication"])
    steps = [
        (3.0, 2.4, "1", "the gradient partition moves to the host"),
        (3.4, 2.95, "2", "Adam steps the fp32 master partition there"),
        (3.0, 3.9, "3", "the updated parameters move back to the GPU"),
    ]
    for row, (x, y, number, words) in enumerate(steps):
        label(axes, x, y, number, ha="center", weight="bold", color=COLORS["communication"])
        label(axes, 0.1, 1.2 - 0.27 * row, number, weight="bold", color=COLORS["communication"])
        label(axes, 0.35, 1.2 - 0.27 * row, words)
    label(axes, 0.1, 0.3, "offload_param (stage 3) keeps the parameter shards on the host too.")
    return figure


FIGURES = {"09_zero_stages.svg": zero_stages, "09_offload_path.svg": offload_path}
