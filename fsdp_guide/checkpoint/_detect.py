"""The engine of a model being saved or loaded (private).

A checkpoint depends on the wrapper, not on how it was configured: the engine's adapter
(:func:`fsdp_guide.engines.engine_for`) says how its state goes in and out.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_guide.engines import Engine, engine_for, unit_of


def engine_of(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, given: Engine | str | None = None
) -> Engine:
    """The engine of ``model`` and ``optimizer``: ``given`` if it is one, else detected.

    Raises:
        TypeError: ``model`` is not a module, or FSDP is applied to sub-modules only (wrap
            the root too: state dicts are taken from the root).
        ValueError: ``given`` names another engine than the model's.

    Examples:
        >>> engine_of(nn.Linear(2, 2), None).name
        'module'
    """
    if isinstance(given, Engine):
        return given
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    engine = engine_for(model, optimizer)
    if unit_of(model) is None and any(unit_of(m) is not None for m in model.modules()):
        raise TypeError(
            "FSDP is applied to sub-modules but not to the root module; wrap the root as well "
            "(fully_shard(model) or FullyShardedDataParallel(model)) before saving or loading"
        )
    if given is not None and given != engine.name:
        raise ValueError(f"this model and optimizer are {engine.name!r}, not {given!r}")
    return engine
