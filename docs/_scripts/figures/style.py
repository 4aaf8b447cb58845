"""The look every lesson figure shares: colours, fonts and how a figure is saved.

Figures are SVG with their text kept as text (searchable, and sharp at any width) on a white
card, so they read the same in the site's light and dark themes. A lesson page is about 358 px
wide on a 390 px phone; :data:`MIN_PHONE_PX` is the smallest label size a figure may shrink to
there, which ``tests/docs/test_figures.py`` checks on every committed file.
"""

from __future__ import annotations

import io
import re

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure

#: One colour per kind of thing, the same in every lesson (colour-blind safe: Okabe-Ito).
COLORS = {
    "parameters": "#0072B2",
    "gradients": "#E69F00",
    "optimizer": "#009E73",
    "activations": "#CC79A7",
    "communication": "#D55E00",
    "compute": "#56B4E9",
    "idle": "#BBBBBB",
    "master": "#F0E442",
    "text": "#222222",
}
FONT = 12  # points
PHONE_WIDTH_PX = 358
MIN_PHONE_PX = 8.5


def new_figure(width: float = 6.0, height: float = 3.6) -> Figure:
    """A blank figure of ``width`` x ``height`` inches on a white card, text kept as text."""
    matplotlib.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "fsdp-guide",
            "font.size": FONT,
            "font.family": "DejaVu Sans",
            "axes.edgecolor": COLORS["text"],
            "text.color": COLORS["text"],
        }
    )
    figure = Figure(figsize=(width, height))
    figure.patch.set_facecolor("white")
    return figure


def to_svg(figure: Figure) -> str:
    """The figure as SVG text that is the same on every run (no date, fixed ids)."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buffer.getvalue()


def smallest_phone_px(svg: str) -> float:
    """The smallest font of ``svg`` in CSS pixels once the figure fits a phone's page width."""
    width = float(re.search(r'viewBox="0 0 ([\d.]+) ', svg).group(1))  # type: ignore[union-attr]
    sizes = [float(s) for s in re.findall(r"font-size: ?([\d.]+)px", svg)]
    return min(sizes) * min(1.0, PHONE_WIDTH_PX / width) if sizes else float("inf")
