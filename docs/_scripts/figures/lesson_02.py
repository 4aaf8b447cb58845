"""Lesson 02's figures: what each ZeRO stage shards, and what OSS does in one step.

``02_zero_stages.svg`` counts fp32 Adam, as the lessons train (4 + 4 + 8 bytes per parameter);
``02_mixed_zero_stages.svg``, on the landing page, the ZeRO paper's mixed-precision Adam
(2 + 2 + 12). Every rank row shows its parameters, gradients and optimizer state; a sharded
block is filled only over the rank's own slice, the rest of it lives on the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

WORLD_SIZE = 4
KINDS = ("parameters", "gradients", "optimizer")
LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state"}
STAGES = (
    ("DDP: every rank holds everything", ()),
    ("ZeRO-1: the optimizer state is sharded", ("optimizer",)),
    ("ZeRO-2: the gradients too", ("optimizer", "gradients")),
    ("ZeRO-3: the parameters too", ("optimizer", "gradients", "parameters")),
)


def zero_stages(sizes: dict[str, float], precision: str) -> Callable[[], Figure]:
    """A function drawing the four stages for ``sizes`` bytes per parameter of each kind."""

    def draw() -> Figure:
        total = sum(sizes.values())
        figure = new_figure(6.0, 8.2)
        axes = figure.subplots(len(STAGES), 1)
        for ax, (title, sharded) in zip(axes, STAGES, strict=True):
            for rank in range(WORLD_SIZE):
                y = WORLD_SIZE - 1 - rank
                x = 0.0
                for kind in KINDS:
                    size, color = sizes[kind], COLORS[kind]
                    if kind in sharded:
                        # The whole block outlined, filled only over this rank's slice.
                        ax.add_patch(
                            Rectangle((x, y + 0.12), size, 0.76, fill=False, ec=color, lw=1.2)
                        )
                        width = size / WORLD_SIZE
                        mine = Rectangle((x + rank * width, y + 0.12), width, 0.76, color=color)
                        ax.add_patch(mine)
                    else:
                        ax.add_patch(Rectangle((x, y + 0.12), size, 0.76, color=color))
                    x += size
                ax.text(-0.3, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=11)
            held = sum(s / WORLD_SIZE if k in sharded else s for k, s in sizes.items())
            ax.text(total + 0.4, WORLD_SIZE / 2, f"{held:g} B\nper rank", va="center", fontsize=12)
            ax.set_title(title, loc="left", fontsize=12.5)
            ax.set_xlim(-3.2, total + 4.2)
            ax.set_ylim(0, WORLD_SIZE)
            ax.axis("off")
        handles = [Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in KINDS]
        labels = [f"{LABELS[k]}, {sizes[k]:g} B" for k in KINDS]
        figure.legend(handles, labels, loc="lower center", ncols=2, frameon=False, fontsize=11.5)
        figure.suptitle(
            f"{precision} Adam on {WORLD_SIZE} ranks, bytes per parameter\n"
            "(outlined: held by the other ranks)",
            fontsize=12,
        )
        figure.tight_layout(rect=(0, 0.07, 1, 0.97))
        return figure

    return draw


def oss_step() -> Figure:
    """One optimizer step of OSS on 4 ranks: all-reduce, update one's own shard, broadcast."""
    figure = new_figure(6.0, 4.8)
    ax = figure.subplots()
    columns = (
        ("1. all-reduce:\nevery rank has\nall gradients", "gradients", None),
        (
            "2. Adam, with the\nrank's quarter of\nits state, updates\nthe rank's quarter",
            "optimizer",
            "own",
        ),
        ("3. broadcast:\nevery rank has\nall new weights", "parameters", None),
    )
    for column, (title, kind, mode) in enumerate(columns):
        x0 = column * 4.2
        ax.text(x0 + 1.6, WORLD_SIZE + 0.25, title, ha="center", va="bottom", fontsize=11.5)
        for rank in range(WORLD_SIZE):
            y = WORLD_SIZE - 1 - rank
            for piece in range(WORLD_SIZE):
                mine = piece == rank
                filled = mode is None or mine
                color = COLORS[kind] if filled else "white"
                edge = "white" if filled else COLORS[kind]
                ax.add_patch(
                    Rectangle((x0 + 0.8 * piece + 0.03, y + 0.15), 0.74, 0.7, facecolor=color,
                              edgecolor=edge, lw=1.2)
                )  # fmt: skip
        if column < 2:
            ax.add_patch(
                FancyArrowPatch((x0 + 3.35, WORLD_SIZE / 2), (x0 + 4.05, WORLD_SIZE / 2),
                                arrowstyle="-|>", mutation_scale=18, color=COLORS["text"])
            )  # fmt: skip
    for rank in range(WORLD_SIZE):
        ax.text(-0.2, WORLD_SIZE - 1 - rank + 0.5, f"rank {rank}", ha="right", va="center",
                fontsize=11)  # fmt: skip
    ax.text(
        6.0,
        -0.35,
        "a block: the quarter of the model's tensors that one rank owns",
        ha="center",
        va="top",
        fontsize=11,
    )
    ax.set_xlim(-1.6, 12.6)
    ax.set_ylim(-0.9, WORLD_SIZE + 1.5)
    ax.axis("off")
    figure.tight_layout()
    return figure


FIGURES = {
    "02_zero_stages.svg": zero_stages(
        {"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0}, "fp32"
    ),
    "02_mixed_zero_stages.svg": zero_stages(
        {"parameters": 2.0, "gradients": 2.0, "optimizer": 12.0}, "Mixed-precision"
    ),
    "02_oss_step.svg": oss_step,
}
