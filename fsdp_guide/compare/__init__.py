"""Train the demo model under each strategy on N ranks, measure every rank, and report it.

What ``python -m fsdp_guide compare`` runs: :func:`run_comparison` launches one training run per
strategy and returns one :class:`ComparisonRow` per strategy and rank, the state measured after
the last ``optimizer.step()`` set next to the prediction, and the collectives of the last step
next to theirs. :func:`comparison_table`, :func:`communication_table`, :func:`plot_comparison`
and :func:`rows_as_json` report the rows; :func:`text_table` lays out any table of text.

Examples:
    >>> from fsdp_guide.compare import text_table
    >>> print(text_table([["strategy", "ZeRO"], ["fsdp", "3"]]))
    strategy  ZeRO
    fsdp      3
"""

from __future__ import annotations

from fsdp_guide.compare._plot import plot_comparison
from fsdp_guide.compare._report import (
    ComparisonRow,
    TableStyle,
    communication_table,
    comparison_table,
    rows_as_json,
    text_table,
)
from fsdp_guide.compare._runs import RankMeasurement, run_comparison, train_and_measure

__all__ = [
    "ComparisonRow",
    "RankMeasurement",
    "TableStyle",
    "communication_table",
    "comparison_table",
    "plot_comparison",
    "rows_as_json",
    "run_comparison",
    "text_table",
    "train_and_measure",
]
