"""fsdp-guide: executable lessons and typed helpers for sharded training in PyTorch.

The top level stays light: it imports torch, not FairScale, Lightning, matplotlib or
IPython. ``%load_ext fsdp_guide`` registers the ``%%distributed`` cell magic.
"""

from __future__ import annotations

from typing import Any

from fsdp_guide.errors import RankError as RankError
from fsdp_guide.launcher import find_free_port as find_free_port
from fsdp_guide.launcher import launch as launch

__version__ = "0.1.0"

# The lessons take launch from the top level: a re-export, documented once, in fsdp_guide.launcher
# (every other name comes from its sub-package). Listed there, not here, so it counts once.
__all__: list[str] = []


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%distributed`` cell magic (called by ``%load_ext fsdp_guide``)."""
    from fsdp_guide.launcher.magic import DistributedMagics

    ipython.register_magics(DistributedMagics)
