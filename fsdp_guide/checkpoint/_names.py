"""Matching a checkpoint to a model by parameter name: clear errors, name-keyed optimizers.

PyTorch optimizers key their state by a parameter's position; ZeRO and OSS do the same
after consolidation. A position means nothing to another model or another wrapping, so a
full checkpoint keys the optimizer state by parameter name (as
:mod:`torch.distributed.checkpoint.state_dict` does) and converts on the way in and out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_guide.errors import CheckpointError

_OptimizerState = dict[str, Any]


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
        fsdp_guide.errors.CheckpointError: the checkpoint does not fit this model: ...
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


def names_in_optimizer_order(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of ``module``'s parameters in the order position-keyed optimizer states count them.

    ``module`` is the unwrapped model (no DDP or ShardedDDP wrapper), so names carry no prefix.

    Raises:
        ValueError: The optimizer holds a parameter that is not the model's.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> names_in_optimizer_order(layer, torch.optim.SGD([layer.bias, layer.weight]))
        ['bias', 'weight']
    """
    names = {id(p): n for n, p in module.named_parameters()}
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


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that keeps the state: the local one inside ZeRO or OSS, else ``optimizer``.

    Examples:
        >>> sgd = torch.optim.SGD(nn.Linear(2, 1).parameters())
        >>> inner_optimizer(sgd) is sgd
        True
    """
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer and OSS keep it here
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def state_keys(state: dict[Any, Any]) -> list[str]:
    """The per-parameter keys of an optimizer state (``state_dict()["state"]``), sorted.

    Examples:
        >>> state_keys({0: {"step": 1, "exp_avg": 0}, 1: {"step": 1, "exp_avg": 0}})
        ['exp_avg', 'step']
    """
    return sorted({str(key) for per_param in state.values() for key in per_param})


def optimizer_record(
    optimizer: torch.optim.Optimizer | None, state: dict[Any, Any] | None
) -> dict[str, Any] | None:
    """What a checkpoint records about its optimizer: its class and the keys of its state.

    Examples:
        >>> sgd = torch.optim.SGD(nn.Linear(2, 1).parameters(), momentum=0.9)
        >>> optimizer_record(sgd, {"w": {"momentum_buffer": None}})
        {'class': 'SGD', 'state_keys': ['momentum_buffer']}
    """
    if optimizer is None or state is None:
        return None
    return {"class": type(inner_optimizer(optimizer)).__name__, "state_keys": state_keys(state)}


# Options that pick an implementation, not the state: left at their defaults for the probe.
_IMPLEMENTATION_OPTIONS = ("params", "foreach", "fused", "capturable", "differentiable")


def expected_state_keys(optimizer: torch.optim.Optimizer) -> list[str] | None:
    """The per-parameter state keys ``optimizer`` keeps once it has stepped, without stepping it.

    From its own state if it has any; else from a probe: an optimizer of the same class and
    hyperparameters, stepped once on a one-element parameter. ``None`` if that fails (an
    optimizer class with other constructor arguments, say).

    Examples:
        >>> params = nn.Linear(2, 1).parameters()
        >>> expected_state_keys(torch.optim.SGD(params, lr=0.1, momentum=0.9))
        ['momentum_buffer']
        >>> expected_state_keys(torch.optim.Adam(nn.Linear(2, 1).parameters()))
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    inner = inner_optimizer(optimizer)
    if inner.state:
        return state_keys(dict(inner.state))
    groups = []
    for group in optimizer.param_groups:
        dummy = torch.zeros(1, requires_grad=True)
        dummy.grad = torch.zeros(1)
        hyper = {k: v for k, v in group.items() if k not in _IMPLEMENTATION_OPTIONS}
        groups.append({**hyper, "params": [dummy]})
    try:
        probe: torch.optim.Optimizer = type(inner)(groups)  # type: ignore[call-arg]
        probe.step()
    except Exception:
        return None
    return state_keys(dict(probe.state))


def check_optimizer_fits(saved: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> None:
    """Raise unless the optimizer state that ``saved`` describes loads into ``optimizer``.

    Args:
        saved: ``{"class", "state_keys"}`` of the checkpoint (``class`` may be ``None`` in
            files that did not record it).
        optimizer: The optimizer to load into.

    Raises:
        CheckpointError: The optimizer classes differ, or the state keys the checkpoint holds
            differ from those the optimizer keeps; naming both.

    Examples:
        >>> adam_state = {"class": "AdamW", "state_keys": ["exp_avg", "exp_avg_sq", "step"]}
        >>> check_optimizer_fits(adam_state, torch.optim.AdamW(nn.Linear(2, 1).parameters()))
        >>> sgd = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
        >>> check_optimizer_fits(adam_state, sgd)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: the checkpoint's optimizer state does not fit this \
optimizer: the checkpoint holds AdamW state (exp_avg, exp_avg_sq, step), this optimizer is \
SGD, which keeps (momentum_buffer). Build the optimizer the checkpoint was saved with \
(AdamW), or pass optimizer=None to load the model only
    """
    if saved is None:
        return
    saved_class, saved_keys = saved.get("class"), list(saved["state_keys"])
    live_class = type(inner_optimizer(optimizer)).__name__
    expected = expected_state_keys(optimizer)
    class_differs = saved_class is not None and saved_class != live_class
    # A checkpoint taken before the first step holds no state: that fits any optimizer.
    keys_differ = bool(saved_keys) and expected is not None and set(saved_keys) != set(expected)
    if not (class_differs or keys_differ):
        return
    keeps = "(unknown)" if expected is None else f"({', '.join(expected) or 'no state'})"
    build = f" ({saved_class})" if saved_class else ""
    raise CheckpointError(
        f"the checkpoint's optimizer state does not fit this optimizer: the checkpoint holds "
        f"{saved_class or 'an optimizer'} state ({', '.join(saved_keys) or 'none yet'}), this "
        f"optimizer is {live_class}, which keeps {keeps}. Build the optimizer the checkpoint "
        f"was saved with{build}, or pass optimizer=None to load the model only"
    )
