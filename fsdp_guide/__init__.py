"""fsdp-guide: executable lessons and typed helpers for sharded training in PyTorch.

The top level stays light: it imports torch, not FairScale, Lightning, matplotlib or
IPython. ``%load_ext fsdp_guide`` registers the ``%%distributed`` cell magic.
"""

from __future__ import annotations

from typing import Any

from fsdp_guide.errors import LaunchError, LaunchTimeout, RankError
from fsdp_guide.launcher import dist_init, find_free_port, launch
from fsdp_guide.memory import (
    ModelState,
    PeakMemory,
    estimate_model_state,
    measure_model_state,
    peak_memory,
)
from fsdp_guide.wrap import (
    LayerPolicy,
    SizePolicy,
    any_of,
    check_optimizer,
    checkpoint_layers,
    describe,
    shard,
)

__version__ = "0.1.0"

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "LayerPolicy",
    "ModelState",
    "PeakMemory",
    "RankError",
    "SizePolicy",
    "__version__",
    "any_of",
    "check_optimizer",
    "checkpoint_layers",
    "describe",
    "dist_init",
    "estimate_model_state",
    "find_free_port",
    "launch",
    "load_ipython_extension",
    "measure_model_state",
    "peak_memory",
    "shard",
]


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%distributed`` cell magic (called by ``%load_ext fsdp_guide``)."""
    from fsdp_guide.launcher.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)
