"""Tables and a bar chart of measured against predicted model state, per strategy and rank.

Used by ``python -m fsdp_guide compare``, the benchmark and the notebooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fsdp_guide.memory._comm import CommStats
from fsdp_guide.memory._comm_zero import CommPrediction
from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._zero import format_bytes


@dataclass(frozen=True)
class ComparisonRow:
    """One rank under one strategy: what it held and what ZeRO predicts.

    Attributes:
        strategy: Strategy name.
        rank: The rank.
        world_size: Ranks in the run.
        zero_stage: The strategy's textbook ZeRO stage.
        measured: Model state measured after ``optimizer.step()``.
        predicted: The ZeRO formula for the state held at that point.
        step_time_s: Mean seconds per training step (not comparable across machines);
            ``None`` when the run was not timed.
        loss: Loss of the last step on this rank.
        peak_bytes: Peak memory reading of the rank.
        peak_kind: What ``peak_bytes`` is: ``"cuda_peak_allocated"`` or ``"cpu_peak_rss"``.
        comm_measured: Collectives the rank issued in one training step; ``None`` when not
            counted.
        comm_predicted: The payload the strategy issues per step
            (:func:`~fsdp_guide.memory.predict_communication`); ``None`` when not counted.
    """

    strategy: str
    rank: int
    world_size: int
    zero_stage: int
    measured: ModelState
    predicted: ModelState
    step_time_s: float | None = None
    loss: float = float("nan")
    peak_bytes: int = 0
    peak_kind: str = "cpu_peak_rss"
    comm_measured: CommStats | None = None
    comm_predicted: CommPrediction | None = None

    @property
    def ratio(self) -> float:
        """Measured total over predicted total.

        Examples:
            >>> row = ComparisonRow("ddp", 0, 1, 0, ModelState(10, 10, 21), ModelState(10, 10, 20))
            >>> round(row.ratio, 3)
            1.025
        """
        return self.measured.total / self.predicted.total if self.predicted.total else float("nan")


def comparison_table(
    rows: Sequence[ComparisonRow], style: Literal["markdown", "plain"] = "markdown"
) -> str:
    """A table with one line per strategy and rank: measured bytes, predicted, ratio, time.

    The ``ms/step`` column is shown only when at least one row was timed (a row without a
    time shows ``-`` in it). ``comm/step`` (payload bytes the rank issued in one step,
    marked ``*`` when the count is incomplete) and ``comm pred`` (the prediction) are shown
    when at least one row counted its collectives. ``master`` (a master copy held apart,
    DeepSpeed's) is shown after ``params`` when a row measured one, and ``buckets``
    (communication buffers kept between steps: DDP's without bucket views, DeepSpeed
    ZeRO-3's reduce bucket) after ``grads`` when a row did, so the columns add up to
    ``measured``.

    Args:
        rows: The rows to show.
        style: ``"markdown"`` (pipes, for notebooks and reports) or ``"plain"`` (aligned
            columns, for a terminal).

    Returns:
        The table as text, without a trailing newline.

    Examples:
        >>> row = ComparisonRow(
        ...     "oss", 1, 2, 1, ModelState(4000, 4000, 4008), ModelState(4000, 4000, 4000), 0.012
        ... )
        >>> header, rule, line = comparison_table([row]).splitlines()
        >>> print(line)
        | oss | 1 | 1 | 4.00 KB | 4.00 KB | 4.01 KB | 12.01 KB | 12.00 KB | 1.001 | 12.0 |
        >>> print(comparison_table([row], style="plain"))
        strategy  ZeRO  rank  params   grads    optimizer  measured  predicted  ratio  ms/step
        oss       1     1     4.00 KB  4.00 KB  4.01 KB    12.01 KB  12.00 KB   1.001  12.0

        Rows that were not timed get no ``ms/step`` column:

        >>> untimed = ComparisonRow("ddp", 0, 1, 0, ModelState(4, 4, 8), ModelState(4, 4, 8))
        >>> print(comparison_table([untimed], style="plain"))
        strategy  ZeRO  rank  params  grads  optimizer  measured  predicted  ratio
        ddp       0     0     4 B     4 B    8 B        16 B      16 B       1.000

        A DeepSpeed ZeRO-3 row shows its master copy and its reduce bucket:

        >>> ds = ModelState(8, 8, 16, buckets=4, master=8)
        >>> print(comparison_table([ComparisonRow("ds", 0, 2, 3, ds, ds)], style="plain"))
        strategy  ZeRO  rank  params  master  grads  buckets  optimizer  measured  predicted  ratio
        ds        3     0     8 B     8 B     8 B    4 B      16 B       44 B      44 B       1.000
    """
    master = any(row.measured.master for row in rows)
    header = ["strategy", "ZeRO", "rank", "params", *(["master"] if master else [])]
    buckets = any(row.measured.buckets for row in rows)
    header += ["grads", *(["buckets"] if buckets else [])]
    header += ["optimizer", "measured", "predicted", "ratio"]
    timed = any(row.step_time_s is not None for row in rows)
    comm = any(row.comm_measured is not None for row in rows)
    if comm:
        header += ["comm/step", "comm pred"]
    if timed:
        header.append("ms/step")
    body = [
        [
            row.strategy,
            str(row.zero_stage),
            str(row.rank),
            format_bytes(row.measured.params),
            *([format_bytes(row.measured.master)] if master else []),
            format_bytes(row.measured.grads),
            *([format_bytes(row.measured.buckets)] if buckets else []),
            format_bytes(row.measured.optimizer),
            format_bytes(row.measured.total),
            format_bytes(row.predicted.total),
            f"{row.ratio:.3f}",
        ]
        + (_comm_cells(row) if comm else [])
        + ([_milliseconds(row.step_time_s)] if timed else [])
        for row in rows
    ]
    if style == "markdown":
        lines = [header, ["---"] * len(header), *body]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    if style != "plain":
        raise ValueError(f"unknown style {style!r}; choose 'markdown' or 'plain'")
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    text_lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]
    ]
    return "\n".join(line.rstrip() for line in text_lines)


_SHORT_KINDS = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG"}


def communication_table(rows: Sequence[ComparisonRow]) -> str:
    """A markdown table of one step's communication per strategy: measured, predicted, paper.

    One line per strategy (rank 0's row; every rank issues the same payload). Payload per
    kind is shown as a multiple of ``Ψ`` (AR all-reduce, RS reduce-scatter, AG all-gather);
    then the measured and predicted payload bytes, the same in the ZeRO paper's convention
    (an all-reduce counts twice), the paper's figure for the stage, and what a ring sends.

    Examples:
        >>> from fsdp_guide.memory import CollectiveCount
        >>> from fsdp_guide.memory import predict_communication
        >>> stats = CommStats({"all_reduce": CollectiveCount(1, 100, 400)})
        >>> state = ModelState(4, 4, 8)
        >>> row = ComparisonRow(
        ...     "ddp", 0, 2, 0, state, state, None, 0.0, 0, "cpu_peak_rss", stats,
        ...     predict_communication("ddp", 100, 2),
        ... )
        >>> print(communication_table([row]).splitlines()[-1])
        | ddp | AR 1.000 | 400 B | 400 B | 2.00 Ψ | 2 Ψ | 1.00 Ψ | yes |
    """
    header = ["strategy", "payload per kind (÷Ψ)", "measured", "predicted"]
    header += ["paper convention", "paper", "ring wire", "complete"]
    lines = [header, ["---"] * len(header)]
    for row in rows:
        measured, predicted = row.comm_measured, row.comm_predicted
        if measured is None or predicted is None or row.rank != 0:
            continue
        psi = predicted.num_params or 1
        kinds = " + ".join(
            f"{_SHORT_KINDS.get(k, k)} {n / psi:.3f}"
            for k, n in measured.elements_by_kind().items()
        )
        lines.append(
            [
                row.strategy,
                kinds or "none",
                format_bytes(measured.bytes),
                format_bytes(predicted.payload_bytes),
                f"{predicted.convention_elements / psi:.2f} Ψ",
                f"{predicted.paper_elements / psi:.0f} Ψ",
                f"{predicted.wire_elements() / psi:.2f} Ψ",
                "yes" if measured.complete else f"no: {measured.reason}",
            ]
        )
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _comm_cells(row: ComparisonRow) -> list[str]:
    measured, predicted = row.comm_measured, row.comm_predicted
    cells = ["-", "-"]
    if measured is not None:
        cells[0] = format_bytes(measured.bytes) + ("" if measured.complete else "*")
    if predicted is not None:
        cells[1] = format_bytes(predicted.payload_bytes)
    return cells


def _comm_json(row: ComparisonRow) -> dict[str, Any] | None:
    measured, predicted = row.comm_measured, row.comm_predicted
    if measured is None and predicted is None:
        return None
    out: dict[str, Any] = {"measured": measured.as_dict() if measured else None}
    if predicted is not None:
        out["predicted"] = {
            "payload": dict(predicted.payload),
            "payload_bytes": predicted.payload_bytes,
            "paper_elements": predicted.paper_elements,
            "paper_bytes": predicted.paper_bytes,
            "ring_wire_elements": predicted.wire_elements("ring"),
            "element_size": predicted.element_size,
        }
    return out


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def rows_as_json(rows: Sequence[ComparisonRow]) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts (byte counts as integers).

    Examples:
        >>> row = ComparisonRow("ddp", 0, 1, 0, ModelState(4, 4, 8), ModelState(4, 4, 8))
        >>> rows_as_json([row])[0]["measured"]
        {'params': 4, 'grads': 4, 'optimizer': 8, 'buckets': 0, 'master': 0, 'total': 16}
    """
    return [
        {
            "strategy": row.strategy,
            "rank": row.rank,
            "world_size": row.world_size,
            "zero_stage": row.zero_stage,
            "measured": row.measured.as_dict(),
            "predicted": row.predicted.as_dict(),
            "ratio": row.ratio,
            "step_time_s": row.step_time_s,
            "loss": row.loss,
            "peak_bytes": row.peak_bytes,
            "peak_kind": row.peak_kind,
            "comm": _comm_json(row),
        }
        for row in rows
    ]


def _bar_groups(rows: Sequence[ComparisonRow]) -> list[tuple[str, ComparisonRow]]:
    """One bar per strategy when its ranks hold the same bytes, else one per rank.

    Examples:
        >>> state = ModelState(1, 1, 1)
        >>> same = [ComparisonRow("ddp", r, 2, 0, state, state) for r in (0, 1)]
        >>> [label for label, _ in _bar_groups(same)]
        ['ddp']
        >>> odd = [ComparisonRow("oss", r, 2, 1, ModelState(1, 1, r), state) for r in (0, 1)]
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

    Ranks that hold the same bytes share one bar; otherwise each rank gets its own.

    matplotlib is imported here, with the non-interactive Agg backend when saving to a file
    outside a notebook.

    Args:
        rows: The rows to draw.
        path: Where to write a PNG; ``None`` to only return the figure.

    Returns:
        The matplotlib ``Figure``.

    Examples:
        >>> import tempfile, os
        >>> row = ComparisonRow("fsdp", 0, 2, 3, ModelState(2, 2, 4), ModelState(2, 2, 4))
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
