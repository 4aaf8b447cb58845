"""Lesson 06: what activation checkpointing keeps, and what it computes twice."""

from __future__ import annotations

from itertools import pairwise

from matplotlib.figure import Figure
from shapes import LABEL, SMALL, box, canvas, label, legend
from style import COLORS

BLOCKS = 4
FULL = 1.0  # what one block keeps for backward without checkpointing (relative)
INPUT = 0.25  # its input alone


def _step(checkpointed: bool) -> list[tuple[str, float, bool]]:
    """(name, duration, recompute?) of each block's work in one step: forward, then backward
    from the last block; a checkpointed block recomputes its forward before its backward."""
    work = [(f"F{i}", 1.0, False) for i in range(1, BLOCKS + 1)]
    for i in range(BLOCKS, 0, -1):
        if checkpointed:
            work.append((f"R{i}", 1.0, True))
        work.append((f"B{i}", 2.0, False))
    return work


def _held(checkpointed: bool) -> list[tuple[float, float]]:
    """(time, activations held) after each piece of work starts, as a step function."""
    times, held, t = [], [], 0.0
    kept = [0.0] * (BLOCKS + 1)
    for name, duration, _ in _step(checkpointed):
        block = int(name[1])
        if name[0] == "F":
            kept[block] = INPUT if checkpointed else FULL
        elif name[0] == "R":
            kept[block] = FULL  # the recomputed intermediates, for this block only
        times.append(t)
        held.append(sum(kept))
        if name[0] == "B":
            kept[block] = 0.0  # freed once the block's gradients are computed
        t += duration
    times.append(t)
    held.append(sum(kept))
    return list(zip(times, held, strict=True))


def recompute() -> Figure:
    figure, axes = canvas(6.0, 5.4)
    unit = 5.3 / 16  # inches per unit of time: the longer step (16 units) fills the width
    x0 = 0.35
    panels = [
        (False, 5.0, "Without checkpointing: every block keeps its intermediates"),
        (True, 2.45, "Checkpointed: keep each input, recompute before backward"),
    ]
    for checkpointed, top, title in panels:
        label(axes, 0.05, top, title, size=LABEL, weight="bold")
        y = top - 0.62
        t = 0.0
        for name, duration, again in _step(checkpointed):
            box(
                axes,
                x0 + t * unit,
                y,
                duration * unit,
                0.38,
                "white" if again else COLORS["compute"],
                name,
                hatch="//" if again else None,
                edge=COLORS["compute"] if again else COLORS["text"],
            )
            t += duration
        # Activations held over the step, on the same time axis (same scale in both panels).
        base, scale = y - 1.55, 1.3 / (BLOCKS * FULL)
        points = _held(checkpointed)
        for (start, value), (end, _) in pairwise(points):
            if value:
                box(
                    axes,
                    x0 + start * unit,
                    base,
                    (end - start) * unit,
                    value * scale,
                    COLORS["activations"],
                    edge=COLORS["activations"],
                )
        axes.plot([x0, x0 + 16 * unit], [base, base], color=COLORS["text"], linewidth=1)
        peak = max(v for _, v in points)
        axes.plot(
            [x0, x0 + 16 * unit],
            [base + peak * scale] * 2,
            color=COLORS["text"],
            linewidth=1,
            linestyle="--",
        )
        words = "peak: all four blocks" if not checkpointed else "peak: inputs + one block"
        label(axes, x0 + 16 * unit, base + peak * scale + 0.13, words, ha="right")
        label(axes, 0.05, base + 0.75, "held", size=SMALL, rotation=90, ha="center")
    legend(
        axes,
        0.35,
        0.15,
        [
            (COLORS["compute"], "F forward, B backward"),
            ("white", "R recompute", "//", COLORS["compute"]),
            (COLORS["activations"], "activations"),
        ],
    )
    return figure


FIGURES = {"06_recompute.svg": recompute}
