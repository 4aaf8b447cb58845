"""Activation checkpointing of selected layers: :func:`checkpoint_layers`.

A checkpointed layer keeps only its inputs for the backward pass and runs its forward a
second time, during backward, to get the activations back: less activation memory, about
one more forward of compute. Checkpoint layers (for example each transformer block), never
the whole model: checkpointing the root saves nothing (its input must be kept and
everything recomputed at once) and is known to break training loops, so it is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from fsdp_guide.engines import PARAM_BUFFERS, local_tensor
from fsdp_guide.wrap._policy import LayerPolicy

CheckpointImplementation = Literal["torch", "fairscale"]
LayerSelection = (
    type[nn.Module] | tuple[type[nn.Module], ...] | LayerPolicy | Callable[[nn.Module], bool]
)


def _predicate(layers: LayerSelection) -> Callable[[nn.Module], bool]:
    if isinstance(layers, LayerPolicy):
        classes = layers.layer_classes
    elif isinstance(layers, type | tuple):
        classes = LayerPolicy(*layers if isinstance(layers, tuple) else (layers,)).layer_classes
    elif callable(layers):
        return layers
    else:
        raise TypeError(
            f"layers must be a Module class, a tuple of them, a LayerPolicy or a predicate "
            f"module -> bool, got {layers!r}"
        )
    return lambda module: isinstance(module, classes)


def _matching_layers(
    model: nn.Module, matches: Callable[[nn.Module], bool]
) -> list[tuple[str, bool]]:
    """(name, already checkpointed) of the outermost matching modules below the root."""
    from fsdp_guide.wrap._inspect import is_checkpointed

    found: list[tuple[str, bool]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            inner = getattr(child, "_checkpoint_wrapped_module", child)
            if matches(inner):
                found.append((name, is_checkpointed(child)))
            else:
                visit(child, name)

    visit(model, "")
    return found


def checkpointed_names(model: nn.Module, layers: LayerSelection) -> list[str]:
    """Qualified names of the modules :func:`checkpoint_layers` would checkpoint.

    The outermost matching modules below the root, in module order; modules checkpointed
    already are listed under their own name (no wrapper attribute in it).

    Raises:
        ValueError: If the root itself matches (checkpoint its layers instead) or nothing does.

    Examples:
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> checkpointed_names(model, Block)
        ['blocks.0', 'blocks.1']
        >>> checkpointed_names(model, TinyTransformer)
        Traceback (most recent call last):
        ...
        ValueError: activation checkpointing of the root module (TinyTransformer) is refused: ...
    """
    matches = _predicate(layers)
    if matches(model):
        raise ValueError(
            f"activation checkpointing of the root module ({type(model).__name__}) is refused: "
            "it saves no memory and breaks training. Select its layers instead, e.g. "
            "checkpoint_layers(model, layers=Block)"
        )
    names = [name for name, _ in _matching_layers(model, matches)]
    if not names:
        raise ValueError(
            f"no module of {type(model).__name__} matches layers={layers!r}; pass the class "
            "of the layers to checkpoint, e.g. layers=Block"
        )
    return names


def checkpoint_layers(
    model: nn.Module,
    layers: LayerSelection,
    implementation: CheckpointImplementation = "torch",
    offload_to_cpu: bool = False,
) -> nn.Module:
    """Apply activation checkpointing to the layers of ``model`` that ``layers`` selects.

    Do it before :func:`fsdp_guide.wrap.shard`, so each checkpointed layer can still be
    found by a :class:`~fsdp_guide.wrap.LayerPolicy` and becomes its own unit.

    ``implementation="torch"`` wraps each layer in PyTorch's non-reentrant
    ``CheckpointWrapper``. ``implementation="fairscale"`` patches each layer's forward with
    FairScale's ``checkpoint_wrapper``, which also patches BatchNorm layers so their running
    statistics are updated once per step; the plain recomputation of PyTorch's wrapper runs
    BatchNorm's forward twice in training mode and updates ``running_mean``, ``running_var``
    and ``num_batches_tracked`` twice. FairScale's FSDP works only with its own: sharded with
    ``engine="fairscale_fsdp"``, layers checkpointed by PyTorch's wrapper are checkpointed by
    FairScale's instead, inside their unit.

    Args:
        model: The model; changed in place.
        layers: A Module class, a tuple of classes, a :class:`~fsdp_guide.wrap.LayerPolicy`
            or a predicate ``module -> bool``.
        implementation: ``"torch"`` or ``"fairscale"``.
        offload_to_cpu: FairScale only: keep the saved inputs on the CPU.

    Returns:
        ``model``, with the selected layers checkpointed.

    Raises:
        ValueError: Unknown implementation, the root selected, nothing selected, or
            ``offload_to_cpu`` with the torch implementation.
        TypeError: ``layers`` of the wrong kind.

    Examples:
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import describe
        >>> model = checkpoint_layers(TinyTransformer(TransformerConfig(n_layers=2)), Block)
        >>> print(describe(model, max_depth=2))
        (root): TinyTransformer
          tok_emb: Embedding
          pos_emb: Embedding
          blocks: ModuleList
            0: Block  [checkpointed]
            1: Block  [checkpointed]
          ln_f: LayerNorm
          head: Linear
    """
    if implementation not in ("torch", "fairscale"):
        raise ValueError(
            f"unknown implementation {implementation!r}; choose 'torch' or 'fairscale'"
        )
    if offload_to_cpu and implementation == "torch":
        raise ValueError("offload_to_cpu needs implementation='fairscale'")
    checkpointed_names(model, layers)  # validates: root refused, something selected
    names = [name for name, done in _matching_layers(model, _predicate(layers)) if not done]
    if implementation == "fairscale":
        from fairscale.nn.checkpoint import checkpoint_wrapper as fairscale_checkpoint

        for name in names:
            fairscale_checkpoint(model.get_submodule(name), offload_to_cpu=offload_to_cpu)
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for name in names:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = checkpoint_wrapper(
            parent.get_submodule(child_name), checkpoint_impl=CheckpointImpl.NO_REENTRANT
        )
        setattr(parent, child_name, wrapped)
    return model


def _live_storage(tensor: Tensor | None) -> torch.UntypedStorage | None:
    """The storage holding ``tensor``'s data on this rank, or None if it holds no bytes now."""
    if tensor is None:
        return None
    storage = local_tensor(tensor).untyped_storage()
    return storage if storage.nbytes() else None


def _storage_key(storage: torch.UntypedStorage) -> int:
    """What tells live storages apart: the address; for meta storages (fake tensors too),
    which all sit at address 0, the storage object, which a view shares and a new tensor not.
    """
    if storage.device.type == "meta":
        return int(storage._cdata)
    return int(storage.data_ptr())


def _parameter_storages(model: nn.Module) -> set[int]:
    """Addresses of the live storages that hold ``model``'s parameters, sharded or gathered."""
    tensors: list[Tensor | None] = []
    for module in model.modules():
        # FSDP1 with use_orig_params keeps its FlatParameter out of parameters().
        flat = getattr(module, "_flat_param", None)
        candidates = [*module.parameters(recurse=False), *([flat] if flat is not None else [])]
        for parameter in candidates:
            tensors.append(parameter)
            # Its shards and gathered copies; gradient buffers are never saved for backward.
            tensors.extend(getattr(parameter, name, None) for name in PARAM_BUFFERS)
    storages = (_live_storage(tensor) for tensor in tensors)
    return {_storage_key(storage) for storage in storages if storage is not None}


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Tensor]) -> tuple[int, Tensor]:
    """Bytes of the activations autograd keeps for backward once ``forward()`` has run.

    The tensors saved for backward are collected with
    :func:`torch.autograd.graph.saved_tensors_hooks`; when ``forward()`` returns, each
    storage still allocated is counted once, except those holding ``model``'s parameters:
    what activation checkpointing is about. A checkpointed layer keeps only its inputs.

    Under FSDP (FairScale, PyTorch FSDP1 or FSDP2) autograd also saves the gathered,
    unsharded weights each layer needs in backward. They are parameters, not activations:
    FSDP frees them after the unit's forward (and gathers them again in backward), and those
    it keeps (the root unit, ``reshard_after_forward=False``, ``SHARD_GRAD_OP``) are left out
    as parameters. So each rank gets the same count as one process running its local batch.

    Args:
        model: The model (plain or sharded) whose parameters are not counted.
        forward: Runs the forward pass (and the loss) and returns its output.

    Returns:
        The bytes and the output of ``forward()`` (to call ``backward`` on).

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> x = torch.randn(16, 4)
        >>> nbytes, out = saved_activation_bytes(model, lambda: model(x).sum())
        >>> nbytes  # x (16x4), the ReLU output (16x8): float32
        768
    """
    # Weak references: a tensor autograd no longer holds when forward returns (its graph
    # was dropped) is not counted, and a freed storage cannot be confused with a new one.
    saved: list[weakref.ref[Tensor]] = []

    def pack(tensor: Tensor) -> Tensor:
        # Autograd keeps what pack returns until backward. The tensor itself would be a
        # reference cycle when it is its own node's output (ReLU, exp...), alive even after
        # its graph is dropped; a detached view of the same storage is not.
        held = tensor.detach()
        saved.append(weakref.ref(held))
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    # Parameters are looked up after forward: FSDP swaps in gathered ones while they are used.
    parameter_storages = _parameter_storages(model)
    held: dict[int, int] = {}
    for reference in saved:
        storage = _live_storage(reference())
        key = None if storage is None else _storage_key(storage)
        if storage is not None and key is not None and key not in parameter_storages:
            held[key] = storage.nbytes()
    return sum(held.values()), out
