"""Small helpers of :class:`~fsdp_guide.strategies.DDPFullyShardedStrategy` that need no GPU.

TODO(lead): switch to ``fsdp_guide.wrap`` helpers once that branch is merged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.optim import Optimizer

__all__ = [
    "apply_activation_checkpointing",
    "check_optimizers_use_sharded_params",
    "contains_fsdp",
    "normalize_layer_classes",
]


def normalize_layer_classes(
    layers: type[nn.Module] | Sequence[type[nn.Module]] | None,
) -> tuple[type[nn.Module], ...]:
    """A layer class or list of them, as a tuple usable with ``isinstance``.

    Raises:
        TypeError: For anything that is not an ``nn.Module`` subclass.

    Examples:
        >>> normalize_layer_classes(nn.Linear)
        (<class 'torch.nn.modules.linear.Linear'>,)
        >>> normalize_layer_classes(None)
        ()
        >>> normalize_layer_classes([nn.Linear(2, 2)])
        Traceback (most recent call last):
        ...
        TypeError: activation_checkpointing takes nn.Module subclasses (e.g. MyBlock), got ...
    """
    if layers is None:
        return ()
    items = [layers] if isinstance(layers, type) else list(layers)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(
                f"activation_checkpointing takes nn.Module subclasses (e.g. MyBlock), got {item!r}"
            )
    return tuple(items)


def apply_activation_checkpointing(model: nn.Module, layers: tuple[type[nn.Module], ...]) -> int:
    """Make every submodule of the given classes recompute activations in backward.

    Uses FairScale's ``checkpoint_wrapper``, which patches ``forward`` in place.

    Returns:
        How many modules were wrapped.

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> apply_activation_checkpointing(model, (nn.Linear,))
        2
    """
    if not layers:
        return 0
    from fairscale.nn.checkpoint import checkpoint_wrapper

    targets = [m for m in model.modules() if isinstance(m, layers)]
    for module in targets:
        checkpoint_wrapper(module)
    return len(targets)


def contains_fsdp(model: nn.Module) -> bool:
    """Whether any module in ``model`` is a FairScale ``FullyShardedDataParallel``.

    Examples:
        >>> contains_fsdp(nn.Linear(2, 2))
        False
    """
    from fairscale.nn import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def check_optimizers_use_sharded_params(
    optimizers: Iterable[Optimizer], sharded_model: nn.Module, hint: str
) -> None:
    """Raise when an optimizer updates none of the sharded model's parameters.

    Args:
        optimizers: The optimizers ``configure_optimizers`` returned.
        sharded_model: The wrapped model (its parameters are the shards).
        hint: The fix, appended to the message.

    Raises:
        ValueError: When an optimizer references none of ``sharded_model.parameters()``.

    Examples:
        >>> import torch
        >>> model, other = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(model.parameters())], model, "")
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(other.parameters())], model, "fix")
        Traceback (most recent call last):
        ...
        ValueError: optimizer 0 (SGD) references none of the sharded parameters; fix
    """
    sharded = {id(p) for p in sharded_model.parameters()}
    for index, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in sharded for p in params):
            raise ValueError(
                f"optimizer {index} ({type(optimizer).__name__}) references none of the sharded"
                f" parameters; {hint}"
            )
