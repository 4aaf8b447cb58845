"""Training state in and out of each way of sharding: the part of a checkpoint that is collective.

A *full* state is the one an unsharded model would have: parameter names without wrapper
prefixes (``module.``, ``_fsdp_wrapped_module.``), whole tensors, and an optimizer state
keyed by parameter name instead of position, so it loads into any strategy at any world
size. A *sharded* state is what one rank holds (PyTorch FSDP1 and FSDP2 through
:mod:`torch.distributed.checkpoint.state_dict`; FairScale FSDP through its local state
dict); ``fsdp_guide/checkpoint/_shards.py`` writes and reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fsdp_guide.checkpoint._detect import Strategy, unwrap
from fsdp_guide.checkpoint._names import (
    check_names_and_shapes,
    names_in_optimizer_order,
    optimizer_state_by_name,
    optimizer_state_by_position,
    shape_of,
)

_OptimizerState = dict[str, Any]


@contextlib.contextmanager
def kept_fresh(optimizer: torch.optim.Optimizer | None) -> Iterator[bool]:
    """Keep an optimizer that has not stepped yet without state through DCP's state dict calls.

    ``get_state_dict`` and ``set_state_dict`` create the state of an optimizer that has none
    by stepping it once with lr 0: its step counts become 1 and its moments 0, which changes
    its next update (Adam's bias correction), so a checkpoint taken before the first step
    would change the run it was taken from. Yields whether ``optimizer`` has no state; if
    so, it has none again on leaving.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> adam = torch.optim.Adam(layer.parameters())
        >>> with kept_fresh(adam) as fresh:
        ...     layer(torch.ones(1, 2)).sum().backward()
        ...     adam.step()
        >>> fresh, len(adam.state)
        (True, 0)
    """
    fresh = optimizer is not None and not optimizer.state
    try:
        yield fresh
    finally:
        if optimizer is not None and fresh:
            optimizer.state.clear()


def without_state(optim_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with its per-parameter state dropped (groups kept).

    Examples:
        >>> without_state({"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.1}]})
        {'state': {}, 'param_groups': [{'lr': 0.1}]}
    """
    return {**optim_state, "state": {}} if "param_groups" in optim_state else optim_state


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_full_fsdp_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gather a PyTorch FSDP model's full state into rank 0 only (collective).

    Every rank takes part in the gathers, one tensor (FSDP2) or one FSDP unit (FSDP1) at a
    time, but only rank 0 keeps what is gathered: the other ranks get empty dicts, so no
    rank but 0 ever holds the whole state. On GPU the copy goes to rank 0's host memory.
    FSDP1 on CPU gathers without "offloading" (``offload_to_cpu=False``): offloading a
    flat parameter that is already on the CPU frees the storage FSDP1 is reading.

    Returns:
        ``(model_state, optimizer_state)``: whole tensors keyed by parameter name on rank 0,
        ``({}, {})`` on the other ranks (and an empty optimizer state without optimizer).

    Raises:
        ValueError: ``strategy`` is not ``"fsdp1"`` or ``"fsdp2"``.

    Examples:
        >>> gather_full_fsdp_state(nn.Linear(2, 1), None, "ddp")
        Traceback (most recent call last):
        ...
        ValueError: gather_full_fsdp_state is for 'fsdp1' and 'fsdp2', not 'ddp'
    """
    if strategy not in ("fsdp1", "fsdp2"):
        raise ValueError(f"gather_full_fsdp_state is for 'fsdp1' and 'fsdp2', not {strategy!r}")
    on_gpu = any(p.is_cuda for p in model.parameters())
    if strategy == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # cpu_offload=True with full_state_dict=True is DCP's rank-0-only mode (CPU too).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with kept_fresh(optimizer) as fresh:
            model_state, optim_state = get_state_dict(
                model, [optimizer] if optimizer is not None else [], options=options
            )
        return dict(model_state), without_state(dict(optim_state)) if fresh else dict(optim_state)
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    # DCP ties FSDP1's rank0_only to cpu_offload, which breaks on CPU: use FSDP1's own API.
    with FSDP1.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True),
    ):
        model_state = model.state_dict()
        optim_state = FSDP1.optim_state_dict(model, optimizer) if optimizer is not None else {}
    return dict(model_state), dict(optim_state)


class _UnmutatedStateDict:
    """Hands FairScale an optimizer state dict it may change without changing the optimizer.

    ``FullyShardedDataParallel.gather_full_optim_state_dict`` turns each ``step`` tensor
    of ``optim.state_dict()`` into a float in place; that dict's per-parameter entries are
    the optimizer's own, and the next ``optimizer.step()`` then fails ("state_steps
    argument must contain a list of singleton tensors"). Copying the entries (not the
    tensors in them) keeps the live optimizer intact.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        return {**state, "state": {k: dict(v) for k, v in state["state"].items()}}


def _consolidate_on_every_rank(
    optimizer: torch.optim.Optimizer, strategy: Strategy
) -> dict[str, Any]:
    """The whole position-keyed state of a ZeRO or OSS optimizer, on every rank (collective)."""
    import torch.distributed as dist

    if strategy != "zero1":
        # FairScale: recipient -1 materialises the whole state on every rank.
        optimizer.consolidate_state_dict(recipient_rank=-1)  # type: ignore[attr-defined]
        return optimizer.state_dict()
    # PyTorch's ZeRO consolidates to one rank per call: rank 0, which then broadcasts it.
    optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    whole = [optimizer.state_dict() if _rank() == 0 else None]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(whole, src=0)
    assert whole[0] is not None
    return whole[0]


def get_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy
) -> tuple[dict[str, Any] | None, _OptimizerState | None]:
    """Gather the full model and optimizer state (collective: call on every rank).

    Parameters that every rank replicates (plain module, DDP, ZeRO, OSS, ShardedDDP) are
    returned on every rank, as are ZeRO and OSS optimizer states, which are consolidated on
    every rank. Sharded parameters (FSDP1, FSDP2, FairScale FSDP) are gathered into rank 0
    only (:func:`gather_full_fsdp_state`): the other ranks get ``(None, None)``.

    Returns:
        ``(model_state, optimizer_state)``, or ``(None, None)`` on ranks other than 0 for
        FSDP. The optimizer state is keyed by parameter name, except for FairScale FSDP,
        whose own gathered format (keyed by position) is kept.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> model_state, optim_state = get_full_state(layer, None, "module")
        >>> sorted(model_state), optim_state
        (['bias', 'weight'], None)
    """
    if strategy in ("fsdp1", "fsdp2"):
        model_state, optim_state = gather_full_fsdp_state(model, optimizer, strategy)
        if _rank() != 0:
            return None, None
        return model_state, (optim_state if optimizer is not None else None)
    if strategy == "fairscale_fsdp":
        # FairScale's state_dict() gathers onto every rank's device (its rank-0-only mode
        # is fixed when the model is wrapped); only rank 0 keeps a host copy.
        state = model.state_dict()  # collective: every rank takes part in the gather
        gather = model.gather_full_optim_state_dict  # returns None on ranks other than 0
        gathered = gather(_UnmutatedStateDict(optimizer)) if optimizer else None  # type: ignore[operator]
        if _rank() != 0:
            return None, None
        on_host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return on_host, gathered
    position_keyed = None
    if optimizer is not None and strategy in ("zero1", "oss", "sharded_ddp"):
        position_keyed = _consolidate_on_every_rank(optimizer, strategy)
    model_state = dict(unwrap(model).state_dict())
    if optimizer is None:
        return model_state, None
    if position_keyed is None:
        position_keyed = optimizer.state_dict()
    names = names_in_optimizer_order(unwrap(model), optimizer)
    return model_state, optimizer_state_by_name(position_keyed, names)


def expected_model_shapes(model: nn.Module, strategy: Strategy) -> dict[str, tuple[int, ...]]:
    """Names and whole-tensor shapes of the model's state dict, without gathering anything.

    Examples:
        >>> expected_model_shapes(nn.Linear(3, 2), "module")
        {'weight': (2, 3), 'bias': (2,)}
    """
    if strategy in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        return {k: shape_of(v) for k, v in sharded.items()}
    return {k: shape_of(v) for k, v in unwrap(model).state_dict().items()}


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
    strategy: Strategy,
    model_state: dict[str, Any],
    optim_state: _OptimizerState | None,
) -> None:
    """Load a full state (from :func:`get_full_state`, on every rank) into any strategy.

    Raises:
        CheckpointError: Parameter names or shapes differ (the message lists them).

    Examples:
        >>> source, target = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> set_full_state(target, None, "module", *get_full_state(source, None, "module"))
        >>> torch.equal(source.weight, target.weight)
        True
    """
    if optim_state is not None:
        optim_state = own_storage(optim_state)
    if strategy != "fairscale_fsdp":
        saved_shapes = {k: shape_of(v) for k, v in model_state.items()}
        check_names_and_shapes(expected_model_shapes(model, strategy), saved_shapes)
    if strategy in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if optimizer is not None and optim_state is not None:
            names = [n for g in optim_state["param_groups"] for n in g["params"]]
            _check_optimizer_names(model, names)
        set_state_dict(
            model,
            [optimizer] if optimizer is not None else [],
            model_state_dict=model_state,
            optim_state_dict=optim_state if optimizer is not None and optim_state else {},
            options=StateDictOptions(full_state_dict=True),
        )
        if optimizer is not None and optim_state is not None and not optim_state["state"]:
            optimizer.state.clear()  # saved before its first step: fresh, as it was then
        return
    if strategy == "fairscale_fsdp":
        model.load_state_dict(model_state)
        if optimizer is not None and optim_state is not None:
            # Its gather left each "step" a number; Adam's load_state_dict makes it a tensor.
            shard = model.get_shard_from_optim_state_dict(optim_state)  # type: ignore[operator]
            optimizer.load_state_dict(shard)
        return
    by_position = None
    if optimizer is not None and optim_state is not None:  # checked before the model changes
        ordered = iter(names_in_optimizer_order(unwrap(model), optimizer))
        groups = [[next(ordered) for _ in g["params"]] for g in optimizer.param_groups]
        by_position = optimizer_state_by_position(optim_state, groups)
    unwrap(model).load_state_dict(model_state)
    if optimizer is not None and by_position is not None:
        optimizer.load_state_dict(by_position)


def _check_optimizer_names(model: nn.Module, saved: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Optimizer states of FSDP models are keyed by the unwrapped parameter names.
    options = StateDictOptions(full_state_dict=False)
    params = {k for k in get_model_state_dict(model, options=options)}
    unknown = sorted(set(saved) - params)
    if unknown:
        check_names_and_shapes({}, {n: () for n in unknown}, what="optimizer's parameters")
