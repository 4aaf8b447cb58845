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

    The file carries the SHA-256 of its contents (one more member of the zip archive that
    ``torch.save`` writes, computed from the bytes written), and :func:`load` checks it
    before anything in the file is unpickled: a file whose bytes changed after saving,
    tensor data included, raises :class:`CheckpointError` naming the file (``torch.load``
    itself checks nothing). Each rank hashes the file it reads, which costs one more read
    of it. A full file without that digest, written by an earlier fsdp_guide, is checked
    against the CRC-32s of its zip members instead and loads with a warning: save it again
    to add the digest.

``kind="sharded"``: a directory (FSDP1, FSDP2, FairScale FSDP, DeepSpeed)
    Each rank writes only its own shards, into a fresh ``data-<id>`` sub-directory, beside
    ``extra.pt`` (rank 0's); ``index.json``, written last, names the format, strategy,
    world size, the optimizer's class and state keys, and each file's size and SHA-256.
    The index is replaced last, so until a save completes the directory still describes
    the previous checkpoint; older ``data-*`` directories are then removed.

    PyTorch FSDP1 and FSDP2 shards are a :mod:`torch.distributed.checkpoint` (DCP)
    checkpoint (``__<rank>_0.distcp`` files and ``.metadata``), taken with
    ``get_state_dict`` and written with ``dcp.save``. It loads at any world size, not
    only the one that saved it (tested: saved at 1, 2 and 3 ranks and loaded at every size
    from 1 to 6, with layers of odd sizes that leave some ranks no part of a parameter),
    into FSDP1 or FSDP2 (either loads the other's), and into a plain module or DDP, which
    read whole tensors (in one process with no process group, too). Plain ``dcp.load``
    fails on such FSDP1 checkpoints at more ranks than saved them ("Missing key in
    checkpoint state_dict: optimizer.param_groups"); the planner used here does not. DCP's ``.metadata`` is a
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
    a full checkpoint in one process, after checking every field of the index and every
    file's SHA-256; the index may name only files of its own ``data-<id>`` directory, so
    nothing outside the checkpoint is opened. A ``DST`` inside ``SRC``, or one of its files
    under another name, is refused before anything is written. Directories of format 1
    (PyTorch FSDP shards as ``rank<N>.pt``) are refused with a message saying how to
    convert them. See ``fsdp_guide/checkpoint/_dir.py`` and
    ``fsdp_guide/checkpoint/_shards.py``.

Atomic, and nothing left behind: files are written beside their target under a name that
says who writes them (``.NAME.tmp-<host>-<pid>-*``), flushed, ``fsync``-ed and renamed into
place (DCP writes and ``fsync``-s its own into the fresh ``data-<id>`` directory, which
nothing reads until the index names it), so the previous checkpoint stays whole until the
new one is. A failed save removes what it wrote before any rank raises: its temporary file,
or on every rank the attempt's ``data-<id>`` directory. What a process killed outright
(SIGKILL, out of memory) leaves is removed by the next save of the same target: temporary
files of this host whose writer is gone, and ``data-*`` directories the index does not
name. A load never removes anything. A write that runs out of space (a full disk, a quota,
a file size limit) raises a :class:`CheckpointError` that says so, with the free space and
the bytes this process's part of the save takes, where ``torch.save`` alone reports an
``unexpected pos`` in ``inline_container.cc``.

Files are read with ``torch.load(weights_only=True)``: see ``fsdp_guide/checkpoint/_io.py``.
Any failure on one rank makes every rank raise the same :class:`CheckpointError`, so no rank
is left waiting in a collective and nothing is loaded partially. A checkpoint whose
optimizer state is of another type (Adam's into SGD) is refused, naming both classes and
their state keys, before anything is loaded.
"""

from __future__ import annotations

from fsdp_guide.checkpoint._api import load, save
from fsdp_guide.checkpoint._consolidate import consolidate
from fsdp_guide.checkpoint._detect import Strategy, detect_strategy
from fsdp_guide.errors import CheckpointError

__all__ = ["CheckpointError", "Strategy", "consolidate", "detect_strategy", "load", "save"]
