"""Small helpers of :class:`~fsdp_guide.strategies.DDPFullyShardedStrategy` that need no GPU.

They stay on FairScale's own API (``checkpoint_wrapper``, ``FullyShardedDataParallel``), which
is what the strategy exposes to users through ``fairscale.nn.wrap``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.optim import Optimizer


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
    optimizers: Iterable[Optimizer],
    sharded_model: nn.Module,
    hint: str,
    module_params: Iterable[nn.Parameter] = (),
) -> None:
    """Raise when an optimizer misses the sharded model's parameters in a way that is a mistake.

    Two mistakes are caught: an optimizer that updates none of the sharded parameters (it
    was built from the parameters FSDP replaced), and one built from the LightningModule's
    ``self.parameters()`` after inner layers were wrapped: that sees the inner wrappers'
    shards but not the shard of the root wrapper, which would silently never train.

    Args:
        optimizers: The optimizers ``configure_optimizers`` returned.
        sharded_model: The wrapped model (its parameters are the shards).
        hint: The fix, appended to the message.
        module_params: ``lightning_module.parameters()`` after wrapping, to recognise an
            optimizer built from them; empty to skip that check.

    Raises:
        ValueError: When an optimizer references no shard, or only the module's own shards.

    Examples:
        >>> import torch
        >>> model, other = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(model.parameters())], model, "")
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(other.parameters())], model, "fix")
        Traceback (most recent call last):
        ...
        ValueError: optimizer 0 (SGD) references none of the sharded parameters; fix
        >>> root = nn.Sequential(model, other)  # as if ``other`` were the root's own shard
        >>> sgd = torch.optim.SGD(model.parameters())
        >>> check_optimizers_use_sharded_params([sgd], root, "fix", model.parameters())
        Traceback (most recent call last):
        ...
        ValueError: optimizer 0 (SGD) was built from the module's own parameters, ...
    """
    sharded = {id(p) for p in sharded_model.parameters()}
    own = {id(p) for p in module_params}
    for index, optimizer in enumerate(optimizers):
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not params & sharded:
            raise ValueError(
                f"optimizer {index} ({type(optimizer).__name__}) references none of the sharded"
                f" parameters; {hint}"
            )
        if own and params == own and own < sharded:
            missing = len(sharded - own)
            raise ValueError(
                f"optimizer {index} ({type(optimizer).__name__}) was built from the module's own"
                f" parameters, which miss {missing} sharded parameter(s) of the root FSDP"
                f" wrapper (they would never be updated); {hint}"
            )
