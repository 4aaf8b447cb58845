"""Boxes, arrows and labels for diagram figures, on a canvas measured in inches.

A diagram is drawn on one axes whose data units are the figure's inches (``canvas``), so a
label placed at ``x=1.5`` sits an inch and a half from the left edge whatever the figure's
size. Every size here is in points; keep labels at :data:`SMALL` or larger so they stay
legible on a phone (``style.MIN_PHONE_PX``).
"""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

SMALL = 11  # points: 8.8 CSS px once a 6-inch figure shrinks to a phone's page
LABEL = 12
TITLE = 13


def canvas(width: float, height: float) -> tuple[Figure, Axes]:
    """A figure and one borderless axes whose data coordinates are inches from bottom left."""
    figure = new_figure(width, height)
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(0, width)
    axes.set_ylim(0, height)
    axes.axis("off")
    return figure, axes


def box(
    axes: Axes,
    x: float,
    y: float,
    width: float,
    height: float,
    color: str,
    label: str = "",
    *,
    size: float = SMALL,
    text_color: str = COLORS["text"],
    hatch: str | None = None,
    fill: bool = True,
    weight: str = "normal",
    edge: str = COLORS["text"],
    linestyle: str = "-",
) -> None:
    """A rectangle with its bottom-left corner at (x, y) and an optional centred label."""
    axes.add_patch(
        Rectangle(
            (x, y),
            width,
            height,
            facecolor=color if fill else "white",
            edgecolor=edge,
            hatch=hatch,
            linewidth=1.0,
            linestyle=linestyle,
        )
    )
    if label:
        axes.text(
            x + width / 2,
            y + height / 2,
            label,
            ha="center",
            va="center",
            fontsize=size,
            color=text_color,
            weight=weight,
        )


def arrow(
    axes: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    color: str = COLORS["text"],
    *,
    both: bool = False,
    width: float = 1.4,
    style: str = "-",
) -> None:
    """An arrow from ``start`` to ``end`` (arrowheads at both ends with ``both``)."""
    axes.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="<|-|>" if both else "-|>",
            mutation_scale=12,
            color=color,
            linewidth=width,
            linestyle=style,
            shrinkA=0,
            shrinkB=0,
        )
    )


def label(
    axes: Axes, x: float, y: float, text: str, *, size: float = SMALL, **options: Any
) -> None:
    """Text at (x, y), left-aligned and vertically centred unless ``options`` say otherwise."""
    options.setdefault("ha", "left")
    options.setdefault("va", "center")
    options.setdefault("color", COLORS["text"])
    axes.text(x, y, text, fontsize=size, **options)


def legend(axes: Axes, x: float, y: float, entries: list[tuple[str, ...]]) -> None:
    """A row of colour swatches with names, from (x, y): (colour, name[, hatch[, edge]])."""
    for color, name, *more in entries:
        hatch = more[0] if more else None
        edge = more[1] if len(more) > 1 else COLORS["text"]
        box(axes, x, y - 0.09, 0.22, 0.18, color, hatch=hatch, edge=edge)
        label(axes, x + 0.28, y, name)
        x += 0.28 + 0.085 * len(name) + 0.25
