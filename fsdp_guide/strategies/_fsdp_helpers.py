"""Small helpers of :class:`~fsdp_guide.strategies.DDPFullyShardedStrategy` that need no GPU.

The checks and activation checkpointing are :mod:`fsdp_guide.wrap`'s, with messages that
speak of the strategy's arguments and of ``configure_optimizers``. Checkpointing uses
FairScale's ``checkpoint_wrapper``, and wrapping FairScale's ``FullyShardedDataParallel``:
what the strategy exposes to users through ``fairscale.nn.wrap``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.optim import Optimizer

from fsdp_guide.errors import OptimizerMismatchError
from fsdp_guide.wrap import (
    check_layer_classes,
    check_optimizer,
    checkpoint_layers,
    checkpointed_names,
)


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
        TypeError: activation_checkpointing takes nn.Module subclasses, got Linear(...); pass ...
    """
    if layers is None:
        return ()
    items = [layers] if isinstance(layers, type) else list(layers)
    return check_layer_classes(
        items, "activation_checkpointing", "activation_checkpointing=[Block]"
    )


def apply_activation_checkpointing(model: nn.Module, layers: tuple[type[nn.Module], ...]) -> int:
    """Make every submodule of the given classes recompute activations in backward.

    :func:`fsdp_guide.wrap.checkpoint_layers` with FairScale's ``checkpoint_wrapper``, which
    patches ``forward`` in place: the outermost matching modules below the root, each once.

    Returns:
        How many modules are checkpointed.

    Raises:
        ValueError: When ``model`` itself is of one of the classes, or nothing is.

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> apply_activation_checkpointing(model, (nn.Linear,))
        2
        >>> apply_activation_checkpointing(model, (nn.Conv1d,))
        Traceback (most recent call last):
        ...
        ValueError: activation_checkpointing=[Conv1d]: no module of Sequential matches ...
    """
    if not layers:
        return 0
    try:
        names = checkpointed_names(model, layers)
    except ValueError as err:
        given = ", ".join(cls.__name__ for cls in layers)
        raise ValueError(f"activation_checkpointing=[{given}]: {err}") from None
    checkpoint_layers(model, layers, implementation="fairscale")
    return len(names)


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

    Each optimizer goes through :func:`fsdp_guide.wrap.check_optimizer` (``partial``: several
    optimizers may each train a part): one holding tensors that are not the sharded
    parameters was built from the parameters FSDP replaced. One more mistake is caught here:
    an optimizer built from the LightningModule's ``self.parameters()`` after inner layers
    were wrapped sees the inner wrappers' shards but not the shard of the root wrapper,
    which would silently never train.

    Args:
        optimizers: The optimizers ``configure_optimizers`` returned.
        sharded_model: The wrapped model (its parameters are the shards).
        hint: The fix, appended to the message.
        module_params: ``lightning_module.parameters()`` after wrapping, to recognise an
            optimizer built from them; empty to skip that check.

    Raises:
        OptimizerMismatchError: (a ``ValueError``) When an optimizer holds no parameters,
            holds tensors that are not shards, or only the module's own shards.

    Examples:
        >>> import torch
        >>> model, other = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(model.parameters())], model, "")
        >>> check_optimizers_use_sharded_params([torch.optim.SGD(other.parameters())], model, "fix")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.OptimizerMismatchError: optimizer 0 (SGD): the optimizer holds 2 ... fix
        >>> root = nn.Sequential(model, other)  # as if ``other`` were the root's own shard
        >>> sgd = torch.optim.SGD(model.parameters())
        >>> check_optimizers_use_sharded_params([sgd], root, "fix", model.parameters())
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.OptimizerMismatchError: optimizer 0 (SGD) was built from the ...
    """
    sharded = {id(p) for p in sharded_model.parameters()}
    own = {id(p) for p in module_params}
    for index, optimizer in enumerate(optimizers):
        label = f"optimizer {index} ({type(optimizer).__name__})"
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if own and params == own and own < sharded:
            missing = len(sharded - own)
            raise OptimizerMismatchError(
                f"{label} was built from the module's own parameters, which miss {missing}"
                " sharded parameter(s) of the root FSDP wrapper (they would never be updated);"
                f" {hint}"
            )
        try:
            # Partial: each of several optimizers may train its own part of the model.
            check_optimizer(sharded_model, optimizer, partial=True, fix=hint)
        except OptimizerMismatchError as err:
            raise OptimizerMismatchError(f"{label}: {err}") from None
