"""Save and load training state under any sharding strategy.

The calls: :func:`~fsdp_guide.checkpoint.save` and :func:`~fsdp_guide.checkpoint.load`.

What to call, and when (every call but :func:`consolidate` is collective: every rank calls
it with its own model and optimizer):

- :func:`save` every N steps or at the end of an epoch. ``kind="full"`` (the default) writes
  one file that loads at any world size into any strategy; ``kind="sharded"`` (FSDP1, FSDP2,
  FairScale FSDP, DeepSpeed) has each rank write only its own shards, for states too large
  to gather on one rank. ``extra`` (step, epoch, RNG states) is saved with it.
- ``save(..., kind="sharded", blocking=False)`` (FSDP1, FSDP2) saves while training goes
  on; the handle's ``wait()`` finishes it.
- :func:`load` after building the model and optimizer exactly as for training; it returns
  that ``extra``. Restoring RNG states from it is yours to do, since only you know which
  generators matter.
- :func:`consolidate` (or ``python -m fsdp_guide consolidate SRC DST``) turns a sharded
  checkpoint into one full file, in one process, without the model code.

The engine (plain module, DDP, ``ZeroRedundancyOptimizer``, FairScale OSS, ShardedDDP and
FSDP, PyTorch FSDP1 and FSDP2, DeepSpeed) is read from the model and optimizer by
:func:`fsdp_guide.engines.engine_for`; its adapter (:class:`fsdp_guide.engines.Engine`) moves its
state.

A failure on any rank raises the same :class:`~fsdp_guide.errors.CheckpointError` on every
rank, so no rank is left waiting and nothing is loaded halfway. Every file is checked against
a SHA-256, and a failed or killed save leaves nothing the next save does not remove. The two
formats, what loads where, and how files are written and read safely:
:doc:`/guide/checkpoints`. PyTorch FSDP shards are written with `torch.distributed.checkpoint
<https://docs.pytorch.org/docs/stable/distributed.checkpoint.html>`__ (DCP), DeepSpeed's
with its own `checkpointing <https://deepspeed.readthedocs.io/en/latest/model-checkpointing.html>`__.
"""

from __future__ import annotations

from fsdp_guide.checkpoint._api import load, save
from fsdp_guide.checkpoint._async import AsyncSave as AsyncSave
from fsdp_guide.checkpoint._consolidate import consolidate
from fsdp_guide.checkpoint._into_shards import load_full_state_dict
from fsdp_guide.checkpoint._into_shards import read_full_state_dict as read_full_state_dict

# Documented in fsdp_guide.errors; importable from here too, as the lessons catch it.
from fsdp_guide.errors import CheckpointError as CheckpointError

__all__ = ["consolidate", "load", "load_full_state_dict", "save"]
