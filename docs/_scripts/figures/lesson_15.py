"""Lesson 15's concept figure: two ways to accumulate gradients over micro-steps with FSDP2."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

K = 3  # micro-steps drawn


def _row(ax: object, y: float, title: str, held_full: bool, sync_each: bool) -> None:
    ax.text(0.0, y + 1.55, title, fontsize=12, fontweight="bold", va="bottom")  # type: ignore[attr-defined]
    for step in range(K):
        x = step * 3.3
        ax.add_patch(  # type: ignore[attr-defined]
            Rectangle((x, y + 0.55), 2.3, 0.8, color=COLORS["compute"], alpha=0.9)
        )
        ax.text(x + 1.15, y + 0.95, f"fwd + bwd {step + 1}", ha="center", va="center", fontsize=11)  # type: ignore[attr-defined]
        reduce = sync_each or step == K - 1
        # The gradients held after this micro-step: the whole model's, or a 1/N shard.
        width = 2.3 if held_full and not reduce else 2.3 / 2
        ax.add_patch(Rectangle((x, y), width, 0.42, color=COLORS["gradients"]))  # type: ignore[attr-defined]
        label = "whole grads" if width > 2 else "shard"
        ax.text(x + width / 2, y + 0.21, label, ha="center", va="center", fontsize=11)  # type: ignore[attr-defined]
        if reduce:
            arrow = FancyArrowPatch(
                (x + 2.35, y + 0.95),
                (x + 3.05, y + 0.2),
                arrowstyle="-|>",
                mutation_scale=12,
                color=COLORS["communication"],
                linewidth=1.6,
            )
            ax.add_patch(arrow)  # type: ignore[attr-defined]
            ax.text(x + 2.75, y + 1.2, "RS", fontsize=10, color=COLORS["communication"])  # type: ignore[attr-defined]


def accumulation_modes() -> Figure:
    """Held-back sync (whole gradients, one reduce-scatter) against syncing every micro-step."""
    figure = new_figure(5.6, 4.8)
    ax = figure.add_axes((0.02, 0.12, 0.96, 0.86))
    _row(ax, 2.6, "sync off until the last micro-step", held_full=True, sync_each=False)
    _row(ax, 0.0, "sync every micro-step", held_full=False, sync_each=True)
    ax.text(
        0.0,
        -0.75,
        "RS: reduce-scatter. All-gathers run in every micro-step.",
        fontsize=11,
        color=COLORS["text"],
    )
    ax.set_xlim(-0.1, K * 3.3)
    ax.set_ylim(-0.9, 4.6)
    ax.axis("off")
    return figure


FIGURES = {"15_accumulation_modes.svg": accumulation_modes}
