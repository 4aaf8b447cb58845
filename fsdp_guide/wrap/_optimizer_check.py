"""Catch the classic FSDP mistake: an optimizer built from the parameters of the unwrapped model.

Wrapping replaces parameters: FSDP1 and FairScale flatten them into new flat parameters,
FSDP2 turns each into a new sharded DTensor parameter. An optimizer built before wrapping
(or from a reference kept to the unwrapped model) updates tensors the model no longer
uses, so training silently does nothing; after auto wrapping, the original module may even
have no parameters left, and the optimizer refuses an empty list.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_guide.errors import OptimizerMismatchError

_FIX = (
    "Build the optimizer after wrapping, from the wrapped model's parameters: "
    "model = shard(model, ...); optimizer = torch.optim.SGD(model.parameters(), ...)"
)


def check_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    partial: bool = False,
    fix: str = _FIX,
) -> None:
    """Check that ``optimizer`` trains exactly the trainable parameters of ``model``.

    It fails when the optimizer holds no parameters, holds tensors that are not parameters of
    ``model`` (it was built from the unwrapped model, or before wrapping), or misses trainable
    parameters of ``model``. The message names the fix.

    Args:
        model: The model as it is trained, i.e. after wrapping.
        optimizer: The optimizer that should update it.
        partial: Accept an optimizer that trains only some of the trainable parameters: one
            of several optimizers, each for a part of the model (a GAN's generator, say).
        fix: The advice that ends the message; by default, build the optimizer from the
            model :func:`~fsdp_guide.wrap.shard` returned.

    Raises:
        OptimizerMismatchError: The optimizer does not match the model's parameters.
        TypeError: Arguments of the wrong type.

    Examples:
        >>> model = nn.Linear(2, 2)
        >>> check_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> other = nn.Linear(2, 2)
        >>> try:
        ...     check_optimizer(model, torch.optim.SGD(other.parameters(), lr=0.1))
        ... except OptimizerMismatchError as err:
        ...     print(str(err)[:60])
        the optimizer holds 2 tensor(s) (6 elements) that are not pa
        >>> check_optimizer(model, torch.optim.SGD([model.bias], lr=0.1), partial=True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not held:
        raise OptimizerMismatchError(
            "the optimizer holds no parameters: it was built from a module whose parameters "
            f"moved into the wrapper. {fix}"
        )
    model_ids = {id(p) for p in model.parameters()}
    foreign = [p for p in held if id(p) not in model_ids]
    if foreign:
        numel = sum(p.numel() for p in foreign)
        raise OptimizerMismatchError(
            f"the optimizer holds {len(foreign)} tensor(s) ({numel:,} elements) that are not "
            "parameters of the model: it was built from the unwrapped model, or before "
            f"wrapping, and would update tensors the model no longer uses. {fix}"
        )
    if partial:
        return
    held_ids = {id(p) for p in held}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held_ids]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise OptimizerMismatchError(
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({shown}), so they would never be updated. {fix}"
        )


# Parameters that shard() replaced, by id, held weakly: an entry lives only as long as
# something else (an optimizer built too early) keeps the old parameter alive, and the
# identity check below means a new tensor reusing a dead one's id is never mistaken for it.
_REPLACED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_replaced_by: dict[int, str] = {}  # id -> the engine that replaced it, for the message
_hook: list[RemovableHandle] = []


def watch_replaced_parameters(before: list[nn.Parameter], model: nn.Module, engine: str) -> None:
    """Make ``optimizer.step()`` refuse an optimizer holding parameters that wrapping replaced.

    FSDP2's ``fully_shard`` changes the model in place and :func:`~fsdp_guide.wrap.shard`
    returns the same object, so ``model = shard(model, ...)`` after building the optimizer
    looks harmless, yet the optimizer then steps tensors the model no longer uses: the loss
    stays flat and nothing says why. A global step pre-hook (installed once) checks every
    optimizer's tensors against the parameters replaced so far.

    Args:
        before: The model's parameters before wrapping.
        model: The wrapped model.
        engine: The engine's name, for the message.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> stale = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> watch_replaced_parameters(list(layer.parameters()), nn.Linear(2, 2), "fsdp2")
        >>> layer(torch.ones(2)).sum().backward()
        >>> stale.step()
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.OptimizerMismatchError: this optimizer was built before shard(...)
    """
    kept = {id(p) for p in model.parameters()}
    for p in before:
        if id(p) not in kept:
            _REPLACED[id(p)] = p
            _replaced_by[id(p)] = engine
    if len(_replaced_by) > 4 * len(_REPLACED) + 1024:  # forget ids of dead parameters
        for key in [k for k in _replaced_by if k not in _REPLACED]:
            del _replaced_by[key]
    if _REPLACED and not _hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook.append(register_optimizer_step_pre_hook(_refuse_replaced_parameters))


def _in_place(engine: str) -> bool:
    from fsdp_guide.engines import UnitEngine, engine_class

    try:
        adapter = engine_class(engine)()
    except ValueError:
        return False
    return isinstance(adapter, UnitEngine) and adapter.shards_in_place


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    if not _REPLACED:
        return
    held: list[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in held if _REPLACED.get(id(p)) is p]
    if not stale:
        return
    engine = _replaced_by.get(id(stale[0]), "the engine")
    in_place = " (in place: shard returns the same model object)" if _in_place(engine) else ""
    raise OptimizerMismatchError(
        f"this optimizer was built before shard(..., engine={engine!r}): it holds "
        f"{len(stale)} tensor(s) ({sum(p.numel() for p in stale):,} elements) that shard "
        f"replaced with sharded parameters{in_place}, so stepping it would train nothing. "
        f"{_FIX}"
    )
