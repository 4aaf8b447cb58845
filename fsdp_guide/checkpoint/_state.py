"""Training state in and out of each engine: the part of a checkpoint that is collective.

A *full* state is the one an unsharded model would have: parameter names without wrapper
prefixes (``module.``, ``_fsdp_wrapped_module.``), whole tensors, and an optimizer state
keyed by parameter name instead of position, so it loads into any strategy at any world
size. How an engine gathers and loads its state is its adapter's to say
(:class:`fsdp_guide.engines.Engine`); here the optimizer state is turned from positions into
names and back, and names and shapes are checked before anything changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_guide.checkpoint._detect import engine_of
from fsdp_guide.checkpoint._names import (
    check_names_and_shapes,
    names_in_optimizer_order,
    optimizer_state_by_name,
    optimizer_state_by_position,
    shape_of,
)
from fsdp_guide.engines import Engine

_OptimizerState = dict[str, Any]


def get_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, engine: Engine | str | None = None
) -> tuple[dict[str, Any] | None, _OptimizerState | None]:
    """Gather the full model and optimizer state (collective: call on every rank).

    Parameters that every rank replicates (plain module, DDP, ZeRO, OSS, ShardedDDP) are
    returned on every rank, as are ZeRO and OSS optimizer states, which are consolidated on
    every rank. Sharded parameters (FSDP1, FSDP2, FairScale FSDP) are gathered into rank 0
    only: the other ranks get ``(None, None)``.

    Args:
        model: The model as trained.
        optimizer: Its optimizer, or ``None``.
        engine: Its engine, or the engine's name to check; detected when not given.

    Returns:
        ``(model_state, optimizer_state)``, or ``(None, None)`` on ranks other than 0 for
        FSDP. The optimizer state is keyed by parameter name, except for an engine that keeps
        its own gathered form (FairScale FSDP's, keyed by position).

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> model_state, optim_state = get_full_state(layer, None)
        >>> sorted(model_state), optim_state
        (['bias', 'weight'], None)
    """
    engine = engine_of(model, optimizer, engine)
    model_state, optim_state = engine.full_state(model, optimizer)
    if model_state is None or optimizer is None or optim_state is None:
        return model_state, optim_state
    if engine.full_optimizer_keys == "position":
        names = names_in_optimizer_order(engine.unwrap(model), optimizer)
        optim_state = optimizer_state_by_name(optim_state, names)
    return model_state, optim_state


def expected_model_shapes(
    model: nn.Module, engine: Engine | str | None = None
) -> dict[str, tuple[int, ...]]:
    """Names and whole-tensor shapes of the model's state dict, without gathering anything.

    Examples:
        >>> expected_model_shapes(nn.Linear(3, 2))
        {'weight': (2, 3), 'bias': (2,)}
    """
    engine = engine_of(model, None, engine)
    return {k: shape_of(v) for k, v in engine.expected_state(model).items()}


def own_storage(value: Any, seen: set[int] | None = None) -> Any:
    """``value`` with each tensor that shares storage with an earlier one replaced by a copy.

    FSDP1's full optimizer state gives the parameters of one flat parameter views of one
    storage and a single ``step`` tensor, and ``torch.save`` keeps that sharing. Loaded as
    it is, an optimizer that steps each parameter on its own (a plain module's, FSDP2's)
    would advance that one ``step`` once per parameter, and resume with other losses.

    Examples:
        >>> step = torch.tensor(2.0)
        >>> state = own_storage({"a": {"step": step}, "b": {"step": step}})
        >>> state["a"]["step"] is step, state["b"]["step"] is step, float(state["b"]["step"])
        (True, False, 2.0)
    """
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage().data_ptr()
        if storage in seen and value.numel() > 0:
            return value.clone()
        seen.add(storage)
        return value
    if isinstance(value, dict):
        return {k: own_storage(v, seen) for k, v in value.items()}
    if type(value) in (list, tuple):  # not a named tuple: its constructor differs
        return type(value)(own_storage(v, seen) for v in value)
    return value


def set_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    engine: Engine | str | None,
    model_state: dict[str, Any],
    optim_state: _OptimizerState | None,
) -> None:
    """Load a full state (from :func:`get_full_state`, on every rank) into any engine.

    Raises:
        CheckpointError: Parameter names or shapes differ (the message lists them).

    Examples:
        >>> source, target = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> set_full_state(target, None, None, *get_full_state(source, None))
        >>> torch.equal(source.weight, target.weight)
        True
    """
    engine = engine_of(model, optimizer, engine)
    if optim_state is not None:
        optim_state = own_storage(optim_state)
    if engine.full_optimizer_keys != "own":  # an engine's own form is checked by it
        saved_shapes = {k: shape_of(v) for k, v in model_state.items()}
        check_names_and_shapes(expected_model_shapes(model, engine), saved_shapes)
    if optimizer is not None and optim_state is not None:  # checked before the model changes
        if engine.full_optimizer_keys == "name":
            _check_optimizer_names(model, engine, optim_state)
        elif engine.full_optimizer_keys == "position":
            ordered = iter(names_in_optimizer_order(engine.unwrap(model), optimizer))
            groups = [[next(ordered) for _ in g["params"]] for g in optimizer.param_groups]
            optim_state = optimizer_state_by_position(optim_state, groups)
    engine.load_full_state(model, optimizer, model_state, optim_state)


def _check_optimizer_names(model: nn.Module, engine: Engine, optim_state: dict[str, Any]) -> None:
    # Name-keyed optimizer states (FSDP's) name the unwrapped parameters.
    saved = [n for g in optim_state["param_groups"] for n in g["params"]]
    unknown = sorted(set(saved) - set(engine.expected_state(model)))
    if unknown:
        check_names_and_shapes({}, {n: () for n in unknown}, what="optimizer's parameters")
