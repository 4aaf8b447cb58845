"""Training state in and out of each way of sharding: the part of a checkpoint that is collective.

:func:`detect_strategy` reads the strategy from the types of the model and optimizer.
A *full* state is the one an unsharded model would have: parameter names without wrapper
prefixes (``module.``, ``_fsdp_wrapped_module.``), whole tensors, and an optimizer state
keyed by parameter name instead of position, so it loads into any strategy at any world
size. A *sharded* state is what one rank holds (PyTorch FSDP1 and FSDP2 through
:mod:`torch.distributed.checkpoint.state_dict`; FairScale FSDP through its local state
dict), with the offset of each shard in its whole tensor so shards can be stitched together
offline (:mod:`fsdp_guide.checkpoint_shards`).
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import torch
from torch import nn

from fsdp_guide.checkpoint_io import CheckpointError

__all__ = [
    "SHARDED_STRATEGIES",
    "Strategy",
    "check_names_and_shapes",
    "detect_strategy",
    "get_full_state",
    "set_full_state",
    "shape_of",
    "unwrap",
]

Strategy = Literal[
    "module", "ddp", "zero", "oss", "sharded_ddp", "fsdp1", "fsdp2", "fairscale_fsdp"
]
SHARDED_STRATEGIES: tuple[str, ...] = ("fsdp1", "fsdp2", "fairscale_fsdp")
_OptimizerState = dict[str, Any]


def _fairscale_types() -> tuple[type, type, type] | None:
    # A model can only be a FairScale type if FairScale was imported: keep it lazy.
    if "fairscale" not in sys.modules:
        return None
    from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from fairscale.optim import OSS

    return FullyShardedDataParallel, ShardedDataParallel, OSS


def detect_strategy(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Strategy:
    """Name the way ``model`` and ``optimizer`` are sharded, from their types.

    Checked in this order: FairScale FSDP, PyTorch FSDP2 (``fully_shard`` on the root),
    PyTorch FSDP1, FairScale ShardedDDP, then the optimizer (FairScale OSS, PyTorch
    ``ZeroRedundancyOptimizer``), then DDP, else a plain module.

    Raises:
        TypeError: ``model`` is not a module, or FSDP1/FSDP2 is applied to sub-modules
            only (wrap the root too: state dicts are taken from the root).

    Examples:
        >>> detect_strategy(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters()))
        'module'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    fairscale = _fairscale_types()
    if fairscale is not None and isinstance(model, fairscale[0]):
        return "fairscale_fsdp"
    if isinstance(model, FSDPModule):
        return "fsdp2"
    if isinstance(model, FSDP1):
        return "fsdp1"
    if any(isinstance(m, FSDPModule | FSDP1) for m in model.modules()):
        raise TypeError(
            "FSDP is applied to sub-modules but not to the root module; wrap the root as well "
            "(fully_shard(model) or FullyShardedDataParallel(model)) before saving or loading"
        )
    if fairscale is not None and isinstance(model, fairscale[1]):
        return "sharded_ddp"
    if fairscale is not None and isinstance(optimizer, fairscale[2]):
        return "oss"
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return "zero"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "module"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP or ShardedDDP wrapper (``model.module``), else ``model``.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> unwrap(layer) is layer
        True
    """
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and not _is_torch_fsdp(model) else model


def _is_torch_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return isinstance(model, FSDPModule | FSDP1)


def shape_of(value: Any) -> tuple[int, ...]:
    """Whole-tensor shape of a tensor, DTensor or ShardedTensor.

    Examples:
        >>> shape_of(torch.zeros(2, 3))
        (2, 3)
    """
    size = value.size() if callable(getattr(value, "size", None)) else value.shape
    return tuple(int(n) for n in size)


def check_names_and_shapes(
    expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], what: str = "model"
) -> None:
    """Raise when the names or shapes of ``saved`` differ from those of ``expected``.

    Raises:
        CheckpointError: Listing missing names, unexpected names and differing shapes.

    Examples:
        >>> check_names_and_shapes({"w": (2, 3)}, {"w": (2, 3)})
        >>> check_names_and_shapes({"w": (2, 3), "b": (2,)}, {"w": (3, 3), "c": (1,)})
        Traceback (most recent call last):
        ...
        fsdp_guide.checkpoint_io.CheckpointError: the checkpoint does not fit this model: ...
    """
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {list(saved[k])} vs {what} {list(expected[k])}"
        for k in set(expected) & set(saved)
        if tuple(saved[k]) != tuple(expected[k])
    )
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (
        (f"in the {what} but not in the checkpoint", missing),
        (f"in the checkpoint but not in the {what}", unexpected),
        ("shapes differ", shapes),
    ):
        if items:
            shown = ", ".join(items[:8]) + (
                f", ... ({len(items)} in all)" if len(items) > 8 else ""
            )
            parts.append(f"{label}: {shown}")
    raise CheckpointError(
        f"the checkpoint does not fit this {what}: "
        + "; ".join(parts)
        + ". Build the same architecture that was saved (same sizes and layer names)"
    )


def _names_in_optimizer_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    # Position-keyed optimizer states (torch, ZeRO, OSS) count parameters in this order.
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    unknown = [i for i, p in enumerate(ordered) if id(p) not in names]
    if unknown:
        raise ValueError(
            f"optimizer parameters at positions {unknown[:8]} are not parameters of the model; "
            "build the optimizer from model.parameters()"
        )
    return [names[id(p)] for p in ordered]


def optimizer_state_by_name(state: _OptimizerState, names: list[str]) -> _OptimizerState:
    """Re-key a position-keyed optimizer state dict by parameter name.

    Examples:
        >>> sd = {"state": {1: {"m": 0}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
        >>> optimizer_state_by_name(sd, ["w", "b"])
        {'state': {'b': {'m': 0}}, 'param_groups': [{'lr': 0.1, 'params': ['w', 'b']}]}
    """
    return {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
        ],
    }


def optimizer_state_by_position(state: _OptimizerState, groups: list[list[str]]) -> _OptimizerState:
    """Inverse of :func:`optimizer_state_by_name`, for an optimizer whose groups hold ``groups``.

    ``torch.optim.Optimizer.load_state_dict`` pairs saved and live parameters by their
    order in each group, so the positions are written in the live optimizer's order.

    Raises:
        CheckpointError: The saved parameter names or groups differ from the live ones.

    Examples:
        >>> sd = {"state": {"b": {"m": 0}}, "param_groups": [{"lr": 0.1, "params": ["b", "w"]}]}
        >>> optimizer_state_by_position(sd, [["w", "b"]])
        {'state': {1: {'m': 0}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    names = [n for group in groups for n in group]
    saved_groups = [list(g["params"]) for g in state["param_groups"]]
    saved = [n for group in saved_groups for n in group]
    if sorted(saved) != sorted(names):
        check_names_and_shapes(
            dict.fromkeys(names, ()), dict.fromkeys(saved, ()), what="optimizer's parameters"
        )
    if [sorted(g) for g in saved_groups] != [sorted(g) for g in groups]:
        raise CheckpointError(
            "the optimizer's parameter groups differ from the checkpoint's; build the "
            "optimizer with the same groups as when saving"
        )
    position = {n: i for i, n in enumerate(names)}
    return {
        "state": {position[n]: s for n, s in state["state"].items()},
        "param_groups": [
            {**g, "params": [position[n] for n in live]}
            for g, live in zip(state["param_groups"], groups, strict=True)
        ],
    }


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy
) -> tuple[dict[str, Any] | None, _OptimizerState | None]:
    """Gather the full model and optimizer state on rank 0 (collective: call on every rank).

    Returns:
        ``(model_state, optimizer_state)`` on rank 0, ``(None, None)`` on the other ranks.
        The optimizer state is keyed by parameter name, except for FairScale FSDP, whose
        own gathered format (keyed by position) is kept.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> model_state, optim_state = get_full_state(layer, None, "module")
        >>> sorted(model_state), optim_state
        (['bias', 'weight'], None)
    """
    if strategy in ("fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # On GPU, cpu_offload gathers to rank 0's host memory only. Parameters already on
        # the CPU must not be "offloaded": FSDP1 then frees the storage it is reading.
        on_gpu = any(p.is_cuda for p in model.parameters())
        options = StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)
        model_state, optim_state = get_state_dict(
            model, [optimizer] if optimizer is not None else [], options=options
        )
        if _rank() != 0:
            return None, None
        return dict(model_state), (dict(optim_state) if optimizer is not None else None)
    if strategy == "fairscale_fsdp":
        model_state = model.state_dict()  # collective: every rank takes part in the gather
        gathered = model.gather_full_optim_state_dict(optimizer) if optimizer else None  # type: ignore[operator]
        return (dict(model_state), gathered) if _rank() == 0 else (None, None)
    if optimizer is not None and strategy in ("zero", "oss", "sharded_ddp"):
        consolidate = optimizer.consolidate_state_dict  # type: ignore[attr-defined]
        # Every rank sends its shard; only rank 0 keeps the whole state.
        consolidate(0) if strategy == "zero" else consolidate(recipient_rank=0)
    if _rank() != 0:
        return None, None
    model_state = dict(unwrap(model).state_dict())
    if optimizer is None:
        return model_state, None
    names = _names_in_optimizer_order(model, optimizer)
    return model_state, optimizer_state_by_name(optimizer.state_dict(), names)


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
        return
    if strategy == "fairscale_fsdp":
        model.load_state_dict(model_state)
        if optimizer is not None and optim_state is not None:
            optimizer.load_state_dict(model.get_shard_from_optim_state_dict(optim_state))  # type: ignore[operator]
        return
    unwrap(model).load_state_dict(model_state)
    if optimizer is not None and optim_state is not None:
        ordered = iter(_names_in_optimizer_order(model, optimizer))
        groups = [[next(ordered) for _ in g["params"]] for g in optimizer.param_groups]
        optimizer.load_state_dict(optimizer_state_by_position(optim_state, groups))


def _check_optimizer_names(model: nn.Module, saved: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Optimizer states of FSDP models are keyed by the unwrapped parameter names.
    options = StateDictOptions(full_state_dict=False)
    params = {k for k in get_model_state_dict(model, options=options)}
    unknown = sorted(set(saved) - params)
    if unknown:
        check_names_and_shapes({}, {n: () for n in unknown}, what="optimizer's parameters")
