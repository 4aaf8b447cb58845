"""Save and restore training state for every way of sharding, safely: :func:`save`, :func:`load`.

Both are collective: every rank calls them with its own model and optimizer. The strategy is
read from their types (:func:`detect_strategy`), never passed in: a plain module, DDP,
PyTorch ``ZeroRedundancyOptimizer``, FairScale OSS and ShardedDDP, PyTorch FSDP1 and FSDP2,
and FairScale FSDP. ``extra`` (step, epoch, RNG states as tensors) is saved by rank 0 and
returned by :func:`load`; restoring RNG states from it is the caller's move
(``torch.set_rng_state(extra["rng"])``), since only the caller knows which generators matter.

Two formats:

``kind="full"``: one file, written by rank 0
    The state an unsharded model would have, with the optimizer state keyed by parameter
    name. ZeRO and OSS optimizer states are consolidated on every rank (after ``save``,
    an OSS optimizer's ``state_dict()`` works on any rank) and written once, by rank 0.
    PyTorch FSDP parameters and optimizer states are gathered into rank 0 only, one unit
    or tensor at a time, on CPU as on GPU (into host memory), so no other rank ever holds
    the whole state; FairScale FSDP gathers its parameters on every rank's GPU and rank 0
    copies them to the host. The file loads at any world size and into any strategy
    (FairScale FSDP's optimizer state only into FairScale FSDP, and only its own). Every
    rank reads the whole file when loading: a host with many ranks needs that much memory
    per rank for a moment (DCP's ``broadcast_from_rank0`` would spare it, but with torch
    2.13 on CPU/gloo it did not complete in our trials), or save ``kind="sharded"``.

``kind="sharded"``: a directory (FSDP1, FSDP2, FairScale FSDP)
    ``rank<N>.pt`` per rank and ``extra.pt`` in a ``data-<id>`` sub-directory, and
    ``index.json`` naming the world size, the strategy and each file's size and SHA-256.
    The index is replaced last, so until a save completes the directory still describes
    the previous checkpoint; older ``data-*`` directories are then removed. It loads only
    at the world size that saved it; :func:`consolidate` (or ``python -m fsdp_guide
    consolidate SRC DST``) turns it into a full checkpoint. See
    ``fsdp_guide/checkpoint/_dir.py`` and ``fsdp_guide/checkpoint/_shards.py``.

Files are written beside their target, flushed, ``fsync``-ed and renamed into place, and
read with ``torch.load(weights_only=True)``: see ``fsdp_guide/checkpoint/_io.py``. Any
failure on one rank makes every rank raise the same :class:`CheckpointError`, so no rank is
left waiting in a collective and nothing is loaded partially.
"""

from __future__ import annotations

from fsdp_guide.checkpoint._api import consolidate, load, save
from fsdp_guide.checkpoint._state import Strategy, detect_strategy
from fsdp_guide.errors import CheckpointError

__all__ = ["CheckpointError", "Strategy", "consolidate", "detect_strategy", "load", "save"]
