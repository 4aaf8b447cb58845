"""Train the demo model under each strategy on N ranks, measure every rank, and report it.

What ``python -m fsdp_guide compare`` runs: :func:`run_comparison` launches one training run per
strategy and returns one :class:`ComparisonRow` per strategy and rank, the state measured after
the last ``optimizer.step()`` set next to the prediction, and the collectives of the last step
next to theirs. :func:`comparison_table`, ``communication_table`` and
:func:`plot_comparison` report the rows; :func:`text_table` lays out any table of text.

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
    comparison_table,
    text_table,
)
from fsdp_guide.compare._report import TableStyle as TableStyle
from fsdp_guide.compare._report import communication_table as communication_table
from fsdp_guide.compare._report import rows_as_json as rows_as_json
from fsdp_guide.compare._runs import RankMeasurement as RankMeasurement
from fsdp_guide.compare._runs import run_comparison
from fsdp_guide.compare._runs import train_and_measure as train_and_measure

__all__ = [
    "ComparisonRow",
    "comparison_table",
    "plot_comparison",
    "run_comparison",
    "text_table",
]
