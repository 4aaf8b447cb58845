"""Train the demo model under each strategy on N ranks and measure what every rank holds.

What ``python -m fsdp_guide compare`` runs: :func:`run_comparison` launches one training run per
strategy and returns one :class:`RankMeasurement` per strategy and rank, measured after the last
``optimizer.step()`` and set next to the ZeRO prediction.
"""

from __future__ import annotations

from fsdp_guide.compare._runs import RankMeasurement, run_comparison, train_and_measure

__all__ = ["RankMeasurement", "run_comparison", "train_and_measure"]
