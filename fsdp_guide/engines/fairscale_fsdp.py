"""FairScale's ``FullyShardedDataParallel`` (CUDA only): one flat parameter per unit.

Like PyTorch FSDP1 it flattens each unit's parameters, pads them to a multiple of the ranks
and cuts them into equal chunks, so a rank holds the same bytes after the step. It computes
on the rank's GPU and needs NCCL: on CPU, PyTorch FSDP1 or FSDP2 take its place.

Examples:
    >>> FairScaleFSDP().layout([(10,), (7,)], 2)[1].params
    9
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_guide.engines._base import Built, adam, fully_sharded
from fsdp_guide.engines._checkpoint import rank
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._units import UnitEngine, UnitPolicy, UnitView
from fsdp_guide.engines.fsdp1 import FSDP1
from fsdp_guide.errors import EngineUnavailableError

# Private: readers get an engine from fsdp_guide.engines.engine_for, not by its class.
__all__: list[str] = []


def _fairscale_fsdp_class() -> type[nn.Module] | None:
    """FairScale's FSDP class, or ``None`` while FairScale is not imported (nothing can be
    wrapped by it then)."""
    if "fairscale" not in sys.modules:
        return None
    from fairscale.nn import FullyShardedDataParallel

    cls: type[nn.Module] = FullyShardedDataParallel
    return cls


class UnmutatedStateDict:
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
        """The optimizer's state dict with fresh per-parameter entries."""
        state = self.optimizer.state_dict()
        return {**state, "state": {k: dict(v) for k, v in state["state"].items()}}


def _unflattened_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``gather_full_optim_state_dict`` returns, for a model on one rank.

    FairScale sizes the buffers of that gather from each flat parameter's padded full copy,
    which it allocates only when it shards (more than one rank): on one rank the gather
    fails with an ``AttributeError``. There the optimizer already holds the whole state, so
    it goes straight to FairScale's own unflattening, with what the gather would have passed.
    """
    from fairscale.nn.data_parallel.fsdp_optim_utils import (
        build_unflat_state_dict,
        is_singleton_tensor,
    )
    from fairscale.nn.data_parallel.fully_sharded_data_parallel import get_fsdp_instances

    model._lazy_init()
    # Turns each `step` into a number (hence the copies) and sets aside the state of units
    # that keep theirs local (FairScale's `no_broadcast_optim_state`).
    sd = model._remove_uncollectable_params_from_optim_state_dict(
        UnmutatedStateDict(optimizer).state_dict()
    )
    state: dict[int, dict[str, list[Any]]] = {}
    singleton: dict[int, dict[str, list[Any]]] = {}
    for k, entries in sd.pop("state").items():
        state[k], singleton[k] = {}, {}
        for name, value in entries.items():
            # Each a one-rank "gathered" list, on the host as the gather leaves it.
            copy = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
            (singleton if is_singleton_tensor(value) else state)[k][name] = [copy]
    units = get_fsdp_instances(model, skip_empty=True)
    padding = [[list(unit.numel_padded_per_param) for unit in units]]  # zeros on one rank
    full: dict[str, Any] = build_unflat_state_dict(
        units, padding, state, singleton, model.uncollected_opt_state, sd
    )
    model.uncollected_opt_state = {}
    return full


def fairscale_checkpointing(module: nn.Module) -> nn.Module:
    """``module`` with each layer in a PyTorch checkpoint wrapper checkpointed by FairScale.

    PyTorch's ``CheckpointWrapper`` around a FairScale FSDP unit recomputes the unit's own
    forward during backward (and stops it early, once it has what it needs), so FairScale
    finds the unit still in its forward ("expected to be in states [BACKWARD_PRE,
    BACKWARD_POST] but current state is TrainingState.FORWARD"). FairScale supports its own
    ``checkpoint_wrapper`` inside the unit: it patches the layer's forward in place, the unit
    wraps the layer, and only the layer runs again. The layer's state dict keys and the
    saved activations stay the same.

    Examples:
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import checkpoint_layers
        >>> model = checkpoint_layers(TinyTransformer(TransformerConfig(n_layers=1)), Block)
        >>> type(model.blocks[0]).__name__
        'CheckpointWrapper'
        >>> model = fairscale_checkpointing(model)
        >>> type(model.blocks[0]).__name__, model.blocks[0].forward.func.__name__
        ('Block', '_checkpointed_forward')
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if isinstance(module, CheckpointWrapper):
        from fairscale.nn.checkpoint import checkpoint_wrapper

        inner = fairscale_checkpointing(module.get_submodule("_checkpoint_wrapped_module"))
        checkpointed: nn.Module = checkpoint_wrapper(inner)
        return checkpointed
    for name, child in module.named_children():
        swapped = fairscale_checkpointing(child)
        if swapped is not child:
            setattr(module, name, swapped)
    return module


@dataclass(frozen=True)
class FairScaleFSDP(UnitEngine):
    """FairScale FSDP with Adam, full precision, the whole model one unit."""

    name = "fairscale_fsdp"
    title = "FairScale FSDP"
    mixed_precision = "params"
    maintenance = 2
    sharded_layout = "rank_files"  # its local state dicts, loadable at the same world size
    full_optimizer_keys = "own"  # its gathered optimizer state, keyed by position
    flat_parameters = True
    aliases = ("fairscale",)  # shard()'s name for it before the catalog named every engine
    # FairScale 0.4.13 (FullyShardedDataParallel._init_param_attributes): the fp32 shard, a
    # 16-bit copy, the padded gathered parameter; gradient shards (it makes them p.grad).
    param_buffers = ("_fp32_shard", "_fp16_shard", "_full_param_padded")
    grad_buffers = ("_saved_grad_shard", "_cpu_grad")

    @classmethod
    def recognises(cls, model: nn.Module, optimizer: object) -> bool:
        fsdp = _fairscale_fsdp_class()
        return fsdp is not None and isinstance(model, fsdp)

    def build(self, model: nn.Module, *, device: torch.device, world_size: int, lr: float) -> Built:
        from fairscale.nn import FullyShardedDataParallel

        module: nn.Module = FullyShardedDataParallel(model, mixed_precision=False)
        return module, adam(module.parameters(), lr)

    @property
    def stage_at_step(self) -> int:
        return 3

    def layout(
        self, shapes: Sequence[Sequence[int]], world_size: int, *, fp32_adam: bool = True
    ) -> tuple[Layout, ...] | None:
        return FSDP1().layout(shapes, world_size)  # the same flat, padded shards

    def transient(
        self, *, param_bytes: int, grad_bytes: int, num_params: int, largest_unit: int
    ) -> Transient:
        return Transient(
            bytes=(param_bytes + grad_bytes) * largest_unit,
            kind="largest gathered unit (params + grads)",
        )

    def collectives(
        self, num_params: int, world_size: int, root_unit_params: int = 0
    ) -> Collectives:
        return fully_sharded(num_params, world_size, root_unit_params)

    def full_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """The whole optimizer state gathered on rank 0 (collective); ``None`` elsewhere.

        The live optimizer keeps its ``step`` tensors (see ``UnmutatedStateDict`` in this
        module). On one rank nothing is gathered: FairScale's gather cannot run there, and
        the optimizer's own state is already whole.
        """
        if getattr(model, "world_size", 1) == 1:
            return _unflattened_optimizer_state(model, optimizer)
        gather: Any = model.gather_full_optim_state_dict
        full: dict[str, Any] | None = gather(UnmutatedStateDict(optimizer))
        return full

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Gathered on every rank's GPU (its rank-0-only mode is fixed when the model is
        wrapped); rank 0 keeps a host copy, the other ranks nothing."""
        state = model.state_dict()  # collective: every rank takes part in the gather
        gathered = self.full_optimizer_state(model, optimizer) if optimizer is not None else None
        if rank() != 0:
            return None, None
        on_host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return on_host, gathered

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> None:
        model.load_state_dict(model_state)
        if optimizer is not None and optim_state is not None:
            # Its gather left each "step" a number; Adam's load_state_dict makes it a tensor.
            shard = model.get_shard_from_optim_state_dict(optim_state)  # type: ignore[operator]
            optimizer.load_state_dict(shard)

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        return {
            "model": dict(model.local_state_dict()),  # type: ignore[operator]
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "metadata": model.local_metadata_dict(),  # type: ignore[operator]
        }

    def load_rank_file(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, shard: dict[str, Any]
    ) -> None:
        model.load_local_state_dict(shard["model"])  # type: ignore[operator]
        if optimizer is not None:
            optimizer.load_state_dict(shard["optimizer"])

    @classmethod
    def consolidate_rank_files(cls, shards: list[dict[str, Any]]) -> dict[str, Any]:
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        weights = FullyShardedDataParallel.consolidate_shard_weights(
            [s["model"] for s in shards], [s["metadata"] for s in shards]
        )
        return dict(weights)

    # Units, for wrap's shard(), wrapping() and describe().

    def check_available(self) -> None:
        if not torch.cuda.is_available():
            raise EngineUnavailableError(
                "engine 'fairscale_fsdp' (FairScale's FullyShardedDataParallel) needs CUDA, and "
                "no GPU is visible; on CPU use engine='fsdp1' (PyTorch FSDP1) or engine='fsdp2' "
                "(PyTorch fully_shard)"
            )

    def unit_options(self, options: dict[str, Any]) -> dict[str, Any]:
        from fsdp_guide.launcher import rank_device

        device = rank_device()
        if device.type != "cuda":
            # Its rank device would be the CPU, where FairScale's FSDP cannot compute.
            raise EngineUnavailableError(
                "engine 'fairscale' computes on the rank's GPU, which needs the NCCL backend; "
                "this process group does not use NCCL. Launch with backend='nccl', or use "
                "engine='torch' or engine='fsdp2' on CPU"
            )
        options.setdefault("compute_device", device)
        return options

    def shard(
        self, module: nn.Module, policy: UnitPolicy | None, options: dict[str, Any]
    ) -> nn.Module:
        from fairscale.nn import FullyShardedDataParallel
        from fairscale.nn.wrap import auto_wrap, enable_wrap

        module = fairscale_checkpointing(module)  # the checkpointing FairScale supports
        if policy is not None:
            with enable_wrap(
                wrapper_cls=FullyShardedDataParallel,
                auto_wrap_policy=policy.for_fairscale(),
                **options,
            ):
                module = auto_wrap(module)
        wrapped: nn.Module = FullyShardedDataParallel(module, **options)
        return wrapped

    def wrapping_context(self, options: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        from fairscale.nn import FullyShardedDataParallel
        from fairscale.nn.wrap import enable_wrap

        context: contextlib.AbstractContextManager[None] = enable_wrap(
            wrapper_cls=FullyShardedDataParallel, **options
        )
        return context

    def wrap_unit(
        self, module: nn.Module, options: dict[str, Any], overrides: dict[str, Any]
    ) -> nn.Module:
        from fairscale.nn.wrap import wrap

        # The block's options are enable_wrap's; checkpointing as shard() does it.
        wrapped: nn.Module = wrap(fairscale_checkpointing(module), **overrides)
        return wrapped

    @classmethod
    def unit(cls, module: nn.Module) -> UnitView | None:
        if not cls.recognises(module, None):
            return None
        # FairScale keeps each (flat) parameter's unsharded size in ``_orig_size``.
        sizes: list[torch.Size] = [p._orig_size for p in getattr(module, "params", [])]
        inner = module.get_submodule("_fsdp_wrapped_module")
        if hasattr(inner, "_fpw_module"):  # FlattenParamsWrapper
            inner = inner.get_submodule("_fpw_module")
        return UnitView(inner=inner, params=sum(size.numel() for size in sizes))
