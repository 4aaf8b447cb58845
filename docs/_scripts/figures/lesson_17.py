"""Lesson 17: ring attention's causal work per rank, naive and zigzag; an expert-parallel layer."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, new_figure

RANKS = 4
#: One colour per rank, the same in both figures.
RANK_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7")
SMALL = 11


def _owner(chunk: int, chunks: int, zigzag: bool) -> int:
    """The rank holding query (or key) chunk ``chunk`` of ``chunks``."""
    if not zigzag:
        return chunk
    return chunk if chunk < RANKS else chunks - 1 - chunk


def _grid(ax: object, zigzag: bool, title: str) -> None:
    """The causal attention matrix in chunks: a cell is computed by its query's rank."""
    chunks = 2 * RANKS if zigzag else RANKS
    size = 1.0 / chunks
    work = [0.0] * RANKS
    for q in range(chunks):
        for k in range(chunks):
            if k > q:
                continue
            rank = _owner(q, chunks, zigzag)
            share = 0.5 if k == q else 1.0  # the diagonal chunk: half its pairs
            work[rank] += share * size * size * 2  # of the causal half of the matrix
            ax.add_patch(  # type: ignore[attr-defined]
                Rectangle(
                    (k * size, 1 - (q + 1) * size),
                    size,
                    size,
                    facecolor=RANK_COLORS[rank],
                    edgecolor="white",
                    linewidth=1.0,
                    alpha=0.55 if k == q else 1.0,
                )
            )
    ax.plot([0, 1, 1, 0, 0], [0, 0, 1, 1, 0], color=COLORS["text"], linewidth=1.0)  # type: ignore[attr-defined]
    ax.set_xlim(-0.02, 1.02)  # type: ignore[attr-defined]
    ax.set_ylim(-0.62, 1.2)  # type: ignore[attr-defined]
    ax.set_aspect("equal")  # type: ignore[attr-defined]
    ax.axis("off")  # type: ignore[attr-defined]
    ax.text(0.5, 1.12, title, ha="center", fontsize=12, weight="bold")  # type: ignore[attr-defined]
    ax.text(0.5, 1.03, "keys →", ha="center", fontsize=SMALL)  # type: ignore[attr-defined]
    ax.text(-0.04, 0.5, "queries →", rotation=-90, va="center", ha="right", fontsize=SMALL)  # type: ignore[attr-defined]
    for rank in range(RANKS):
        y = -0.1 - 0.12 * rank
        ax.add_patch(Rectangle((0.0, y - 0.04), 0.08, 0.08, color=RANK_COLORS[rank]))  # type: ignore[attr-defined]
        text = f"rank {rank}: {work[rank]:.0%} of the work"
        ax.text(0.12, y, text, va="center", fontsize=SMALL)  # type: ignore[attr-defined]


def ring_causal_work() -> Figure:
    """Two causal attention matrices cut over 4 ranks: the naive cut and the zigzag cut."""
    figure = new_figure(6.0, 4.2)
    left, right = figure.subplots(1, 2)
    _grid(left, zigzag=False, title="naive: 4 chunks")
    _grid(right, zigzag=True, title="zigzag: 8 chunks")
    figure.subplots_adjust(left=0.06, right=0.99, top=0.98, bottom=0.02, wspace=0.18)
    return figure


def _box(ax: object, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    ax.add_patch(  # type: ignore[attr-defined]
        Rectangle((x, y), w, h, facecolor=color, edgecolor=COLORS["text"], linewidth=0.8)
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL)  # type: ignore[attr-defined]


def _arrow(
    ax: object, start: tuple[float, float], end: tuple[float, float], label: str = ""
) -> None:
    ax.add_patch(  # type: ignore[attr-defined]
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=12,
            linewidth=1.2,
            color=COLORS["communication"],
        )
    )
    if label:
        mid = ((start[0] + end[0]) / 2 + 0.1, (start[1] + end[1]) / 2)
        ax.text(*mid, label, fontsize=SMALL, color=COLORS["communication"], va="center")  # type: ignore[attr-defined]


def expert_dispatch() -> Figure:
    """Two ranks, four experts: route, dispatch (all-to-all), compute, combine (all-to-all)."""
    figure = new_figure(6.0, 5.4)
    ax = figure.subplots()
    ax.set_xlim(0, 6)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    expert_color = ("#BFD9EC", "#BFD9EC", "#F6DDB0", "#F6DDB0")
    for column, rank in enumerate(range(2)):
        x = 0.3 + 3.0 * column
        ax.text(x + 1.2, 6.0, f"rank {rank}", ha="center", fontsize=12, weight="bold")
        tokens = "t0 t1 t2" if rank == 0 else "t3 t4 t5"
        _box(ax, x, 5.1, 2.4, 0.6, f"its tokens {tokens}", "white")
        _box(ax, x, 4.1, 2.4, 0.6, "router: 2 experts each", COLORS["idle"])
        ax.annotate("", (x + 1.2, 4.7), (x + 1.2, 5.1),
                    arrowprops={"arrowstyle": "-|>", "color": COLORS["text"]})  # fmt: skip
        first = 2 * rank
        for i in range(2):
            _box(ax, x + 1.25 * i, 2.3, 1.15, 0.7, f"expert {first + i}", expert_color[first + i])
        _box(ax, x, 0.4, 2.4, 0.6, "weighted sum per token", "white")
    _arrow(ax, (1.5, 4.1), (4.2, 3.0))
    _arrow(ax, (4.5, 4.1), (1.8, 3.0))
    _arrow(ax, (1.5, 4.1), (1.5, 3.0))
    _arrow(ax, (4.5, 4.1), (4.5, 3.0))
    _arrow(ax, (4.2, 2.3), (1.5, 1.0))
    _arrow(ax, (1.8, 2.3), (4.5, 1.0))
    _arrow(ax, (1.5, 2.3), (1.5, 1.0))
    _arrow(ax, (4.5, 2.3), (4.5, 1.0))
    label = {"ha": "center", "va": "center", "fontsize": SMALL, "color": COLORS["communication"],
             "bbox": {"facecolor": "white", "edgecolor": "none", "pad": 2}}  # fmt: skip
    ax.text(3.0, 3.55, "dispatch (all-to-all):\ncounts, then token copies", **label)
    ax.text(3.0, 1.65, "combine (all-to-all):\nresults back", **label)
    figure.subplots_adjust(left=0.01, right=0.99, top=0.99, bottom=0.01)
    return figure


FIGURES = {
    "17_ring_causal_work.svg": ring_causal_work,
    "17_expert_dispatch.svg": expert_dispatch,
}
