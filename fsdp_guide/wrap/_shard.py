"""Shard a model with one of the FSDP engines: :func:`shard`.

The engines are named as in the strategy catalog: ``"fsdp1"`` is PyTorch's FSDP1
``FullyShardedDataParallel``, ``"fsdp2"`` is PyTorch's ``fully_shard``, ``"fairscale_fsdp"`` is
FairScale's ``FullyShardedDataParallel`` (CUDA only); the older spellings ``"torch"`` and
``"fairscale"`` are still accepted. What differs between them (the wrapper, its defaults, how a
policy is handed to it) is the engine's adapter's to say
(:class:`fsdp_guide.engines.UnitEngine`); :func:`shard` checks its arguments and asks it.
Manual wrapping lives in ``fsdp_guide/wrap/_manual.py``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_guide.engines import unit_engine, unit_of
from fsdp_guide.wrap._optimizer_check import watch_replaced_parameters
from fsdp_guide.wrap._policy import WrapPolicy


def check_process_group(what: str) -> None:
    """Raise unless a ``torch.distributed`` process group is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs a torch.distributed process group: call it inside a function run "
            "by fsdp_guide.launch(fn, world_size, backend='gloo') (or under torchrun, or "
            "after torch.distributed.init_process_group)"
        )


def _has_units(module: nn.Module) -> bool:
    return any(unit_of(m) is not None for m in module.modules())


def shard(
    module: nn.Module,
    engine: str = "fsdp2",
    policy: WrapPolicy | None = None,
    **engine_options: Any,
) -> nn.Module:
    """Shard ``module`` with ``engine``: units chosen by ``policy``, then the root.

    Call it on every rank, inside a function run by :func:`fsdp_guide.launch`. Without a
    policy only the root becomes a unit (plus any units made by hand with
    :func:`~fsdp_guide.wrap.wrap`).
    Build the optimizer afterwards, from the returned model's parameters
    (:func:`fsdp_guide.wrap.check_optimizer` catches the opposite).

    With ``"fsdp2"``, which shards in place, an optimizer built before :func:`shard` is
    refused at its first ``step()`` with :class:`~fsdp_guide.errors.OptimizerMismatchError`:
    nothing else would show the mistake. With the other engines
    :func:`~fsdp_guide.wrap.check_optimizer` catches it.

    Args:
        module: The model; every rank must build it with the same weights.
        engine: ``"fsdp2"`` (the default: ``fully_shard`` on a 1-D device mesh over all
            ranks, what PyTorch recommends for new code), ``"fsdp1"`` (PyTorch's
            ``FullyShardedDataParallel``, kept for existing code) or ``"fairscale_fsdp"``
            (CUDA and NCCL only; FairScale is no longer developed); ``"torch"`` and
            ``"fairscale"`` are older names of ``"fsdp1"`` and ``"fairscale_fsdp"``. Each runs on
            :func:`~fsdp_guide.launcher.rank_device`: the rank's GPU under NCCL, the CPU
            under gloo.
        policy: Which submodules become units of their own.
        **engine_options: Passed to the engine's wrapper (e.g. ``sharding_strategy`` for
            FSDP1, ``reshard_after_forward`` or ``mesh`` for FSDP2, ``mixed_precision`` for
            FairScale); FSDP2 also takes ``forward_prefetch`` and ``backward_prefetch``, how
            many blocks each unit gathers ahead.

    Returns:
        The sharded model, a new wrapper for ``"fsdp1"`` and ``"fairscale_fsdp"`` and
        ``module`` itself (changed in place) for ``"fsdp2"``.

    Raises:
        ValueError: Unknown engine; a policy given for a model that already has units;
            ``auto_wrap_policy`` among the engine options; an FSDP2 prefetch count that is
            not an int >= 0.
        EngineUnavailableError: ``"fairscale_fsdp"`` without CUDA (raised before anything else),
            or in a process group that does not use NCCL.
        TypeError: ``module`` is not a Module or ``policy`` not a WrapPolicy.
        RuntimeError: No process group is initialised.

    Examples:
        Sharding needs a process group; the checks run before anything happens:

        >>> shard(nn.Linear(2, 2), engine="fsdp2")
        Traceback (most recent call last):
        ...
        RuntimeError: shard() needs a torch.distributed process group: call it inside ...

        On ranks (here a single one, in this process), each Block becomes a unit:

        >>> import torch.distributed as dist
        >>> from fsdp_guide.launcher import dist_init, find_free_port
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import LayerPolicy, sharded_units
        >>> dist_init(0, 1, backend="gloo", master_port=find_free_port())
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> model = shard(model, engine="fsdp2", policy=LayerPolicy(Block))
        >>> sharded_units(model)
        {'': ('fsdp2', 17472), 'blocks.0': ('fsdp2', 12704), 'blocks.1': ('fsdp2', 12704)}
        >>> dist.destroy_process_group()
    """
    adapter = unit_engine(engine)
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if policy is not None and not isinstance(policy, WrapPolicy):
        raise TypeError(
            f"policy must be a WrapPolicy such as SizePolicy(100_000) or LayerPolicy(Block), "
            f"got {policy!r}"
        )
    if "auto_wrap_policy" in engine_options:
        raise ValueError(
            "pass the wrap policy as policy=SizePolicy(...) / LayerPolicy(...), not as "
            "auto_wrap_policy: shard() converts it for the engine"
        )
    if policy is not None and _has_units(module):
        raise ValueError(
            "this model already has FSDP units (wrapped by hand); auto wrapping needs an "
            "unwrapped model. Pass policy=None to only wrap the root, or drop the manual wraps"
        )
    check_process_group("shard()")
    before = list(module.parameters())
    wrapped = adapter.shard(module, policy, adapter.unit_options(dict(engine_options)))
    if adapter.shards_in_place:
        # Sharded in place, the same object returned: an optimizer built before this call
        # would step the replaced parameters with nothing to show it. FSDP1 and FairScale
        # return a new wrapper, and check_optimizer names that mistake (lesson 04 shows it).
        watch_replaced_parameters(before, wrapped, adapter.name)
    return wrapped
