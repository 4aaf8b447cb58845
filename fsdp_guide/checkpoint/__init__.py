"""Save and restore training state for every way of sharding, safely: :func:`save`, :func:`load`.

Both are collective: every rank calls them with its own model and optimizer. The strategy is
read from their types (:func:`detect_strategy`), never passed in: a plain module, DDP,
PyTorch ``ZeroRedundancyOptimizer``, FairScale OSS and ShardedDDP, PyTorch FSDP1 and FSDP2,
FairScale FSDP, and a DeepSpeed engine. ``extra`` (step, epoch, RNG states as tensors) is
saved by rank 0 and returned by :func:`load`; restoring RNG states from it is the caller's move
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

``kind="sharded"``: a directory (FSDP1, FSDP2, FairScale FSDP, DeepSpeed)
    Each rank writes only its own shards, into a fresh ``data-<id>`` sub-directory, beside
    ``extra.pt`` (rank 0's); ``index.json``, written last, names the format, strategy,
    world size, the optimizer's class and state keys, and each file's size and SHA-256.
    The index is replaced last, so until a save completes the directory still describes
    the previous checkpoint; older ``data-*`` directories are then removed.

    PyTorch FSDP1 and FSDP2 shards are a :mod:`torch.distributed.checkpoint` (DCP)
    checkpoint (``__<rank>_0.distcp`` files and ``.metadata``), taken with
    ``get_state_dict`` and written with ``dcp.save``. It loads at any world size, not
    only the one that saved it (tested from 2 ranks to 1, 3 and 4, from 4 to 2 and 3), into
    FSDP1 or FSDP2 (either loads the other's), and into a plain module or DDP, which read
    whole tensors (in one process with no process group, too). DCP's ``.metadata`` is a
    pickle, read here with an unpickler that builds only DCP's metadata classes, and its
    non-tensor values are read with ``weights_only=True`` (see
    ``fsdp_guide/checkpoint/_dcp.py``). ZeRO and OSS, whose optimizers DCP does not fill,
    load a consolidated file.

    FairScale FSDP shards are ``rank<N>.pt`` files of its local state and load only at the
    world size that saved them.

    A DeepSpeed engine's shards are DeepSpeed's own files, written by
    ``engine.save_checkpoint`` (a write failing on one rank is held until DeepSpeed's
    barriers are passed, then raised on every rank) and read by ``engine.load_checkpoint``
    with ``weights_only=True``; they load into the same ZeRO stage at the same world size.
    :func:`consolidate` turns them into one fp32 model state with DeepSpeed's
    ``zero_to_fp32`` (no optimizer state). A DeepSpeed engine saves only ``kind="sharded"``.

    :func:`consolidate` (or ``python -m fsdp_guide consolidate SRC DST``) turns either into
    a full checkpoint in one process. Directories of format 1 (PyTorch FSDP shards as
    ``rank<N>.pt``) are refused with a message saying how to convert them. See
    ``fsdp_guide/checkpoint/_dir.py`` and ``fsdp_guide/checkpoint/_shards.py``.

Files are written beside their target, flushed, ``fsync``-ed and renamed into place (DCP
writes and ``fsync``-s its own into the fresh ``data-<id>`` directory, which nothing reads
until the index names it), and read with ``torch.load(weights_only=True)``: see
``fsdp_guide/checkpoint/_io.py``. Any
failure on one rank makes every rank raise the same :class:`CheckpointError`, so no rank is
left waiting in a collective and nothing is loaded partially. A checkpoint whose optimizer
state is of another type (Adam's into SGD) is refused, naming both classes and their state
keys, before anything is loaded.
"""

from __future__ import annotations

from fsdp_guide.checkpoint._api import consolidate, load, save
from fsdp_guide.checkpoint._detect import Strategy, detect_strategy
from fsdp_guide.checkpoint._into_shards import load_full_state_dict, read_full_state_dict
from fsdp_guide.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "Strategy",
    "consolidate",
    "detect_strategy",
    "load",
    "load_full_state_dict",
    "read_full_state_dict",
    "save",
]
