"""A bar chart of measured against predicted model state, per strategy and rank (private).

matplotlib is imported when a chart is drawn, not before.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_guide.compare._report import ComparisonRow


def _bar_groups(rows: Sequence[ComparisonRow]) -> list[tuple[str, ComparisonRow]]:
    """One bar per strategy when its ranks hold the same bytes, else one per rank.

    Examples:
        >>> from fsdp_guide.memory import ModelState
        >>> state = ModelState(1, 1, 1)
        >>> def row(name, rank, measured):
        ...     return ComparisonRow(strategy=name, rank=rank, world_size=2, zero_stage=0,
        ...                          measured=measured, predicted=state)
        >>> same = [row("ddp", r, state) for r in (0, 1)]
        >>> [label for label, _ in _bar_groups(same)]
        ['ddp']
        >>> odd = [row("oss", r, ModelState(1, 1, r)) for r in (0, 1)]
        >>> [label for label, _ in _bar_groups(odd)]
        ['oss r0', 'oss r1']
    """
    by_strategy: dict[str, list[ComparisonRow]] = {}
    for row in rows:
        by_strategy.setdefault(row.strategy, []).append(row)
    groups: list[tuple[str, ComparisonRow]] = []
    for name, mine in by_strategy.items():
        if len({(r.measured, r.predicted) for r in mine}) == 1:
            groups.append((name, mine[0]))
        else:
            groups += [(f"{name} r{r.rank}", r) for r in mine]
    return groups


def plot_comparison(rows: Sequence[ComparisonRow], path: str | Path | None = None) -> Any:
    """Bar chart: measured bytes per strategy (stacked by kind) next to the prediction.

    Ranks that hold the same bytes share one bar; otherwise each rank gets its own. A
    measured bar stacks the same kinds as :func:`comparison_table`'s ``measured`` column
    (buckets and a master copy included), so it is as tall as that column says.

    matplotlib is imported here, with the non-interactive Agg backend when saving to a file
    outside a notebook.

    Args:
        rows: The rows to draw.
        path: Where to write a PNG; ``None`` to only return the figure.

    Returns:
        The matplotlib ``Figure``.

    Examples:
        >>> import tempfile, os
        >>> from fsdp_guide.memory import ModelState
        >>> state = ModelState(2, 2, 4)
        >>> row = ComparisonRow(
        ...     strategy="fsdp", rank=0, world_size=2, zero_stage=3, measured=state, predicted=state
        ... )
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     fig = plot_comparison([row], os.path.join(tmp, "memory.png"))
        ...     os.path.getsize(os.path.join(tmp, "memory.png")) > 0
        True
    """
    import matplotlib

    if path is not None and "ipykernel" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _bar_groups(rows)
    labels = [label for label, _ in groups]
    shown = [row for _, row in groups]
    xs = range(len(shown))
    # A fixed width: the site shows the image in a ~700 px column, and a wider figure would
    # be scaled down until its labels are unreadable.
    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    bottom = [0.0] * len(shown)
    kinds = [("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868")]
    if any(row.measured.master for row in shown):  # DeepSpeed's master copy, held apart
        kinds.insert(1, ("master", "#8172b3"))
    if any(row.measured.buckets for row in shown):  # DDP's bucket copy: the table counts it too
        kinds.insert(kinds.index(("grads", "#dd8452")) + 1, ("buckets", "#c49c94"))
    for kind, color in kinds:
        heights = [getattr(row.measured, kind) / 1e6 for row in shown]
        ax.bar(
            [x - 0.2 for x in xs],
            heights,
            0.4,
            bottom=bottom,
            color=color,
            label=f"measured {kind}",
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    predicted = [row.predicted.total / 1e6 for row in shown]
    ax.bar(
        [x + 0.2 for x in xs],
        predicted,
        0.4,
        color="#cccccc",
        edgecolor="black",
        hatch="//",
        label="ZeRO prediction",
    )
    rotation = 25 if len(shown) > 5 else 0
    ax.set_xticks(
        list(xs), labels, fontsize=11, rotation=rotation, ha="right" if rotation else "center"
    )
    ax.tick_params(axis="y", labelsize=11)
    ax.set_ylabel("model state per rank (MB)", fontsize=11)
    world = sorted({row.world_size for row in rows})
    ax.set_title(
        f"Model state per rank, measured vs predicted (world size {', '.join(map(str, world))})",
        fontsize=12,
    )
    # Below the axes, not inside (full-height bars would hide under it) nor beside them (it
    # would take width from the bars).
    ax.legend(
        fontsize=10,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2 if rotation else -0.12),
        ncol=4,
        frameon=False,
    )
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return fig
