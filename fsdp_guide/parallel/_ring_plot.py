"""Ring steps on one time axis, rank by rank (private)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: One recorded step (:func:`~fsdp_guide.parallel.record_ring_steps`).
Event = tuple[str, int, float, float, float]

# The shared look of the guide's figures: compute, gradients, idle.
_COLORS = {"forward": "#56B4E9", "backward": "#E69F00", "idle": "#BBBBBB"}


def _span(ranks: Sequence[Sequence[Event]]) -> tuple[float, float]:
    """(first start, last end) over every rank's steps."""
    return min(e[2] for r in ranks for e in r), max(e[3] for r in ranks for e in r)


def idle_shares(ranks: Sequence[Sequence[Event]]) -> list[float]:
    """Each rank's share of the call spent waiting: from the ranks' first start to the last
    rank's end, the time it computed nothing.

    Examples:
        >>> idle_shares([[("forward", 0, 0.0, 1.0, 1.0)], [("forward", 0, 0.0, 2.0, 1.0)]])
        [0.5, 0.0]
    """
    start, end = _span(ranks)
    return [1 - sum(e[3] - e[2] for e in events) / (end - start) for events in ranks]


def plot_ring_steps(calls: Mapping[str, Sequence[Sequence[Event]]], width: float = 6.0) -> Any:
    """A figure of recorded ring calls: for each label, a row per rank, each ring step's
    compute as a bar (forward, then backward) and the rest of the call, idle, in grey; each
    row says the rank's idle share.

    Args:
        calls: Label (a layout, say) to one call's steps on each rank, ``[rank][step]``,
            as :func:`~fsdp_guide.parallel.record_ring_steps` recorded them on each rank.
        width: The figure's width in inches.

    Returns:
        A matplotlib ``Figure``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sum(len(ranks) for ranks in calls.values()) + len(calls) - 1
    figure, ax = plt.subplots(figsize=(width, 1.4 + 0.6 * rows))
    ticks: list[tuple[int, str]] = []
    y = 0
    for label, ranks in calls.items():
        start, end = _span(ranks)
        idle = idle_shares(ranks)
        for rank, events in enumerate(ranks):
            ax.barh(y, (end - start) * 1e3, height=0.7, color=_COLORS["idle"])
            for phase, _, t0, t1, _ in events:
                ax.barh(
                    y,
                    (t1 - t0) * 1e3,
                    left=(t0 - start) * 1e3,
                    height=0.7,
                    color=_COLORS[phase],
                    edgecolor="white",  # a thin gap between one ring step and the next
                    linewidth=0.8,
                )
            ticks.append((y, f"{label}, rank {rank}\n(idle {idle[rank]:.0%})"))
            y += 1
        y += 1
    ax.set_yticks([t for t, _ in ticks], [text for _, text in ticks])
    ax.invert_yaxis()
    ax.set_xlabel("time from the ranks' common start (ms)")
    handles = [Patch(color=c, label=f"{k} step" if k != "idle" else k) for k, c in _COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3,
              frameon=False)  # fmt: skip
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    figure.tight_layout()
    return figure
