"""Run a training function on N ranks, from a script, a notebook or under ``torchrun``.

:func:`launch` starts the ranks (fork in a notebook, spawn in a script), relays their output
line by line with a ``[rankN]`` prefix, and returns each rank's result; when any rank fails,
it stops them all and raises. :func:`dist_init` joins a process group from the environment
``torchrun`` sets. ``%load_ext fsdp_guide`` registers
:class:`~fsdp_guide.launcher.magic.DistributedMagics`, the ``%%distributed`` cell magic.

Layers, from the caller down: ``_launch`` (arguments checked before any process starts),
``_supervisor`` (one loop in the caller's thread: start, relay, collect, stop), ``_worker``
(what runs inside a rank), ``_output`` (whole-line relay), ``magic`` (the cell magic).
"""

from __future__ import annotations

from fsdp_guide.errors import LaunchError, LaunchTimeout, RankError
from fsdp_guide.launcher._launch import (
    dist_init,
    find_free_port,
    in_interactive_session,
    launch,
    resolve_backend,
)

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "RankError",
    "dist_init",
    "find_free_port",
    "in_interactive_session",
    "launch",
    "resolve_backend",
]
