"""Catch the classic FSDP mistake: an optimizer built from the parameters of the unwrapped model.

Wrapping replaces parameters: FSDP1 and FairScale flatten them into new flat parameters,
FSDP2 turns each into a new sharded DTensor parameter. An optimizer built before wrapping
(or from a reference kept to the unwrapped model) updates tensors the model no longer
uses, so training silently does nothing; after auto wrapping, the original module may even
have no parameters left, and the optimizer refuses an empty list.
"""

from __future__ import annotations

import torch
from torch import nn

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
