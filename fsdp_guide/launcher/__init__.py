"""Run a training function on N ranks, from a script, a notebook or under ``torchrun``.

:func:`launch` starts the ranks (fork in a notebook, spawn in a script), relays their output
line by line with a ``[rankN]`` prefix, and returns each rank's result; when any rank fails,
it stops them all, and everything they started, and raises. Ranks stuck in different
collectives are stopped within seconds
(``CollectiveMismatchError``), and so is a nested ``launch`` that
only some ranks call (``CollectiveCallError``). Under ``torchrun``,
:func:`launch` runs the function once in each process it started, on the process group it
sets up. :func:`rank_device` is the
device a rank computes on: its GPU under NCCL, the CPU under gloo; :func:`plan_ranks` picks
the ranks a lesson starts (every GPU when there are two or more, else CPU ranks under gloo).
``%load_ext fsdp_guide`` registers ``DistributedMagics``, the
``%%distributed`` cell magic.
"""

from __future__ import annotations

# Layers, from the caller down: _launch (launch itself), _checks (its arguments, checked before any
# process starts) and _main_guard (spawn from an unguarded script), _rendezvous (address, ports, the
# torchrun environment), _supervisor (one loop in the caller's thread: start, relay, collect, stop)
# with _reports (what each rank reported, which failure to blame), _stop (stopping ranks, closing
# their descriptors) and _hangs (ranks stuck in different collectives), _worker (what runs inside a
# rank), _tree (nothing a rank starts outlives it: child subreapers), _process_group
# (joining torch.distributed: launched ranks, torchrun, dist_init) with _fresh (store keys no
# earlier torchrun start used), _output (whole-line relay), magic (the cell magic), _plan (ranks and
# backend for a lesson), _orphan (a rank dies with its launcher), _stacks (a rank's stack dump,
# user's frames first), _entry (a collective helper called on some ranks only fails within seconds).
# The errors are documented in fsdp_guide.errors; still importable from here, as before.
from fsdp_guide.errors import CollectiveCallError as CollectiveCallError
from fsdp_guide.errors import CollectiveMismatchError as CollectiveMismatchError
from fsdp_guide.errors import LaunchError as LaunchError
from fsdp_guide.errors import LaunchTimeout as LaunchTimeout
from fsdp_guide.errors import RankError as RankError
from fsdp_guide.launcher._checks import check_world_size as check_world_size
from fsdp_guide.launcher._checks import in_interactive_session as in_interactive_session
from fsdp_guide.launcher._checks import resolve_backend as resolve_backend
from fsdp_guide.launcher._checks import visible_gpus as visible_gpus

# For the package's collective helpers (checkpoint.save and load), not documented for readers.
from fsdp_guide.launcher._entry import every_rank_enters as every_rank_enters
from fsdp_guide.launcher._launch import launch
from fsdp_guide.launcher._plan import RankPlan as RankPlan
from fsdp_guide.launcher._plan import plan_ranks
from fsdp_guide.launcher._process_group import dist_init as dist_init
from fsdp_guide.launcher._process_group import rank_device
from fsdp_guide.launcher._rendezvous import find_free_port

__all__ = [
    "find_free_port",
    "launch",
    "plan_ranks",
    "rank_device",
]
