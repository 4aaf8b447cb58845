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
