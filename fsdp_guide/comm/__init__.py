"""Communication per rank and step: the collectives counted, and predicted.

:func:`count_collectives` counts the collectives a rank issues while a block runs (calls,
elements and bytes per kind, and whether the count is complete, in its ``stats``);
:func:`predict_communication` gives what a strategy's engine issues per step in the same
units, next to the ZeRO paper's volume, so the two compare as
memory does.

Examples:
    >>> from fsdp_guide.comm import predict_communication
    >>> dict(predict_communication("ddp", 1000, 2).payload)
    {'all_reduce': 1000}
"""

from __future__ import annotations

from fsdp_guide.comm._count import CommCounter as CommCounter
from fsdp_guide.comm._count import count_collectives
from fsdp_guide.comm._count import payload_of as payload_of
from fsdp_guide.comm._predict import CommPrediction as CommPrediction
from fsdp_guide.comm._predict import predict_communication
from fsdp_guide.comm._predict import root_unit_params as root_unit_params
from fsdp_guide.comm._stats import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from fsdp_guide.comm._stats import CollectiveCount as CollectiveCount
from fsdp_guide.comm._stats import CollectiveKind as CollectiveKind
from fsdp_guide.comm._stats import CommStats as CommStats

__all__ = [
    "count_collectives",
    "predict_communication",
]
