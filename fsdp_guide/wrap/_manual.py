"""Manual wrapping: :func:`wrapping` and :func:`wrap`.

Model code marks its units with :func:`wrap`. Inside a :func:`wrapping` block each marked
module is sharded with the block's engine and options; outside one, :func:`wrap` returns the
module unchanged, so the same model code runs sharded or not (the idea behind Lightning's
``configure_sharded_model`` hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdp_guide.engines import UnitEngine, unit_engine
from fsdp_guide.wrap._shard import check_process_group


@dataclass
class _WrapContext:
    engine: UnitEngine
    options: dict[str, Any] = field(default_factory=dict)


_ACTIVE: ContextVar[_WrapContext | None] = ContextVar("fsdp_guide_wrap_context", default=None)


@contextlib.contextmanager
def wrapping(engine: str = "fsdp2", **engine_options: Any) -> Iterator[None]:
    """Make :func:`wrap` shard modules with ``engine`` and ``engine_options`` inside the block.

    For ``"fsdp1"`` and ``"fairscale_fsdp"`` this also enters the library's own ``enable_wrap``
    context, so model code that calls ``torch.distributed.fsdp.wrap.wrap`` or
    ``fairscale.nn.wrap.wrap`` directly is covered too. Wrap the root last (``wrap(model)``
    inside the block, or :func:`~fsdp_guide.wrap.shard` with no policy after it).

    Args:
        engine: ``"fsdp2"`` (the default, as for :func:`~fsdp_guide.wrap.shard`), ``"fsdp1"``
            or ``"fairscale_fsdp"`` (or the older ``"torch"`` and ``"fairscale"``).
        **engine_options: As for :func:`fsdp_guide.wrap.shard`.

    Raises:
        ValueError: Unknown engine.
        EngineUnavailableError: ``"fairscale_fsdp"`` without CUDA or NCCL.
        RuntimeError: No process group, or already inside a :func:`wrapping` block.

    Examples:
        On a single rank, in this process:

        >>> import torch.distributed as dist
        >>> from fsdp_guide.launcher import dist_init, find_free_port
        >>> from fsdp_guide.wrap import describe
        >>> dist_init(0, 1, backend="gloo", master_port=find_free_port())
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> with wrapping(engine="fsdp2"):
        ...     model[0] = wrap(model[0])
        ...     model = wrap(model)
        >>> print(describe(model))
        (root): Sequential  [unit: fsdp2, 18 params]
          0: Linear  [unit: fsdp2, 72 params]
          1: ReLU
          2: Linear
        >>> dist.destroy_process_group()
    """
    adapter = unit_engine(engine)
    if _ACTIVE.get() is not None:
        raise RuntimeError("wrapping() blocks do not nest; leave the active block first")
    check_process_group("wrapping()")
    options = adapter.unit_options(dict(engine_options))
    token = _ACTIVE.set(_WrapContext(adapter, options))
    try:
        with adapter.wrapping_context(options):
            yield
    finally:
        _ACTIVE.reset(token)


def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
    """Shard ``module`` as one unit inside a :func:`wrapping` block; return it unchanged outside.

    It dispatches on the block's engine, so it avoids a trap of mixing libraries: PyTorch's
    ``torch.distributed.fsdp.wrap.wrap`` inside FairScale's ``enable_wrap`` (or the other
    way round) silently returns the module unwrapped.

    Args:
        module: The module to make a unit.
        **overrides: Engine options for this unit only, over those of the block.

    Returns:
        The wrapper (``"fsdp1"``, ``"fairscale_fsdp"``), the module sharded in place (``"fsdp2"``),
        or ``module`` itself outside a block.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> wrap(layer) is layer  # no active wrapping() block: nothing happens
        True
    """
    active = _ACTIVE.get()
    if active is None:
        return module
    return active.engine.wrap_unit(module, active.options, overrides)
