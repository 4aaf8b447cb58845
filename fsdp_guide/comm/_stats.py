"""What a count of collectives holds: calls, elements and bytes per kind (private).

:class:`CollectiveCount` is one kind's calls and payload, :class:`CommStats` a rank's count
of every kind with whether it is complete; what the payload of each collective is, and how
it is counted, is :func:`~fsdp_guide.comm.count_collectives`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

CollectiveKind = Literal[
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
]

#: Every kind, in the order tables show them.
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = get_args(CollectiveKind)


@dataclass(frozen=True)
class CollectiveCount:
    """Calls and payload of one kind of collective.

    Attributes:
        calls: Collectives of this kind issued.
        elements: Payload elements (see the module docstring for which tensor is counted).
        bytes: Payload bytes (elements times their element size, each at its own dtype).
        dtypes: The dtypes seen, as ``str(torch.dtype)``, sorted.
    """

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    dtypes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict.

        Examples:
            >>> CollectiveCount(1, 4, 16, ("torch.float32",)).as_dict()["bytes"]
            16
        """
        return {
            "calls": self.calls,
            "elements": self.elements,
            "bytes": self.bytes,
            "dtypes": list(self.dtypes),
        }


@dataclass(frozen=True)
class CommStats:
    """What one rank issued while :func:`count_collectives` was active.

    Attributes:
        kinds: Per collective kind, its :class:`CollectiveCount` (kinds never seen are absent).
        complete: ``False`` when collectives may have been issued that were not counted
            (from another thread, or on a group whose sequence number cannot be read).
        reason: Why ``complete`` is ``False``; ``""`` otherwise.
        unseen_calls: Collectives the process groups issued that the counter did not see.
    """

    kinds: Mapping[str, CollectiveCount] = field(default_factory=dict)
    complete: bool = True
    reason: str = ""
    unseen_calls: int = 0

    @property
    def calls(self) -> int:
        """Collectives counted, all kinds."""
        return sum(c.calls for c in self.kinds.values())

    @property
    def elements(self) -> int:
        """Payload elements counted, all kinds."""
        return sum(c.elements for c in self.kinds.values())

    @property
    def bytes(self) -> int:
        """Payload bytes counted, all kinds.

        Examples:
            >>> stats = CommStats({"all_reduce": CollectiveCount(2, 10, 40)})
            >>> stats.calls, stats.elements, stats.bytes
            (2, 10, 40)
        """
        return sum(c.bytes for c in self.kinds.values())

    def elements_by_kind(self) -> dict[str, int]:
        """Payload elements per kind, in :data:`COLLECTIVE_KINDS` order, barriers left out.

        Examples:
            >>> CommStats({"broadcast": CollectiveCount(1, 3, 12)}).elements_by_kind()
            {'broadcast': 3}
        """
        return {
            k: self.kinds[k].elements
            for k in COLLECTIVE_KINDS
            if k in self.kinds and k != "barrier"
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the per-kind breakdown.

        Examples:
            >>> CommStats({"reduce": CollectiveCount(1, 3, 12)}).as_dict()["kinds"]["reduce"]
            {'calls': 1, 'elements': 3, 'bytes': 12, 'dtypes': []}
        """
        return {
            "calls": self.calls,
            "elements": self.elements,
            "bytes": self.bytes,
            "complete": self.complete,
            "reason": self.reason,
            "unseen_calls": self.unseen_calls,
            "kinds": {k: c.as_dict() for k, c in self.kinds.items()},
        }
