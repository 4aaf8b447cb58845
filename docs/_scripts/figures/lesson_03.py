"""Lesson 03's figure: DDP's all-reduce against ShardedDDP's reduce to each gradient's owner.

Four ranks, each with the gradients of four groups of tensors after backward (rank 0's
``a0 … a3``, ...); OSS made rank ``r`` the owner of group ``r``. An all-reduce leaves every
sum on every rank, though each rank updates only its own group; ShardedDDP reduces each
group to its owner only, and the other ranks free their copy.
"""

from __future__ import annotations

from lesson_01 import FONT, WORLD_SIZE, _panel
from matplotlib.figure import Figure
from style import new_figure


def reduce_to_owner() -> Figure:
    """Two panels: DDP's all-reduce (with OSS), then ShardedDDP's reduce to the owner."""
    own = [[f"{'abcd'[r]}{p}" for p in range(WORLD_SIZE)] for r in range(WORLD_SIZE)]
    total = [f"S{p}" for p in range(WORLD_SIZE)]
    mine = [[f"S{p}" if p == r else "" for p in range(WORLD_SIZE)] for r in range(WORLD_SIZE)]
    figure = new_figure(6.0, 5.4)
    axes = figure.subplots(2, 1)
    _panel(axes[0], "OSS with DDP: all-reduce, every sum everywhere", own, [total] * WORLD_SIZE)
    _panel(axes[1], "ShardedDDP: reduce each sum to its owner", own, mine)
    figure.text(
        0.5,
        0.015,
        "Rank r owns group r of the parameters (OSS's partition)\n"
        "and updates only those: it needs only the sum S_r.",
        ha="center",
        va="bottom",
        fontsize=FONT + 0.5,
    )
    figure.tight_layout(rect=(0, 0.1, 1, 1), h_pad=1.2)
    return figure


FIGURES = {"03_reduce_to_owner.svg": reduce_to_owner}
