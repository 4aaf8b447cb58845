"""Communication per rank and step: the collectives counted, and predicted.

:func:`count_collectives` counts the collectives a rank issues while a block runs (calls,
elements and bytes per kind, and whether the count is complete, in a :class:`CommStats`);
:func:`predict_communication` gives what a strategy's engine issues per step in the same
units, next to the ZeRO paper's volume, in a :class:`CommPrediction`, so the two compare as
memory does. :func:`root_unit_params` is the part of a fully sharded model that is gathered
once per step, not twice.

Examples:
    >>> from fsdp_guide.comm import predict_communication
    >>> dict(predict_communication("ddp", 1000, 2).payload)
    {'all_reduce': 1000}
"""

from __future__ import annotations

from fsdp_guide.comm._count import (
    COLLECTIVE_KINDS,
    CollectiveCount,
    CollectiveKind,
    CommCounter,
    CommStats,
    count_collectives,
    payload_of,
)
from fsdp_guide.comm._predict import CommPrediction, predict_communication, root_unit_params

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveCount",
    "CollectiveKind",
    "CommCounter",
    "CommPrediction",
    "CommStats",
    "count_collectives",
    "payload_of",
    "predict_communication",
    "root_unit_params",
]
