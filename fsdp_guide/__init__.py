"""fsdp-guide: executable lessons and typed helpers for sharded training in PyTorch.

The top level stays light: it imports torch, not FairScale, Lightning, matplotlib or
IPython. ``%load_ext fsdp_guide`` registers the ``%%distributed`` cell magic.
"""

from __future__ import annotations

from typing import Any

from fsdp_guide.errors import RankError
from fsdp_guide.launcher import find_free_port, launch

__version__ = "0.1.0"

# What the lessons take from the top level; everything else from its sub-package.
__all__ = ["RankError", "find_free_port", "launch"]


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%distributed`` cell magic (called by ``%load_ext fsdp_guide``)."""
    from fsdp_guide.launcher.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)
