"""Shard a model with one of three engines: :func:`shard`.

The engines are named as in the strategy catalog (:data:`fsdp_guide.catalog.STRATEGIES`):
``"fsdp1"`` is PyTorch's FSDP1 ``FullyShardedDataParallel``, ``"fsdp2"`` is PyTorch's
``fully_shard``, ``"fairscale_fsdp"`` is FairScale's ``FullyShardedDataParallel`` (CUDA only).
The older spellings ``"torch"`` and ``"fairscale"`` are still accepted. :func:`shard`
wraps a whole model following a :class:`~fsdp_guide.wrap.WrapPolicy`; manual wrapping
lives in ``fsdp_guide/wrap/_manual.py``.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from torch import nn

from fsdp_guide.errors import EngineUnavailableError
from fsdp_guide.launcher import rank_device
from fsdp_guide.wrap._optimizer_check import watch_replaced_parameters
from fsdp_guide.wrap._policy import WrapPolicy, selected_modules

Engine = Literal["fsdp1", "fsdp2", "fairscale_fsdp"]
ENGINES: tuple[str, ...] = ("fsdp1", "fsdp2", "fairscale_fsdp")
# Names this module used before the catalog gave every engine one name.
_OLD_NAMES = {"torch": "fsdp1", "fairscale": "fairscale_fsdp"}


def check_engine(engine: object) -> Engine:
    """Validate an engine name against this machine.

    Args:
        engine: ``"fsdp1"``, ``"fsdp2"`` or ``"fairscale_fsdp"`` (or the older ``"torch"``
            and ``"fairscale"``).

    Returns:
        The engine's name in the catalog.

    Raises:
        ValueError: For an unknown name.
        EngineUnavailableError: For ``"fairscale_fsdp"`` without CUDA.

    Examples:
        >>> check_engine("fsdp2"), check_engine("torch")
        ('fsdp2', 'fsdp1')
        >>> check_engine("deepspeed")
        Traceback (most recent call last):
        ...
        ValueError: unknown engine 'deepspeed'; choose one of 'fsdp1', 'fsdp2', 'fairscale_fsdp'
    """
    name = _OLD_NAMES.get(engine, engine) if isinstance(engine, str) else engine
    if name not in ENGINES:
        choices = ", ".join(repr(e) for e in ENGINES)
        raise ValueError(f"unknown engine {engine!r}; choose one of {choices}")
    if name == "fairscale_fsdp" and not torch.cuda.is_available():
        raise EngineUnavailableError(
            "engine 'fairscale_fsdp' (FairScale's FullyShardedDataParallel) needs CUDA, and no "
            "GPU is visible; on CPU use engine='fsdp1' (PyTorch FSDP1) or engine='fsdp2' "
            "(PyTorch fully_shard)"
        )
    return cast(Engine, name)


def _check_process_group(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs a torch.distributed process group: call it inside a function run "
            "by fsdp_guide.launch(fn, world_size, backend='gloo') (or under torchrun, or "
            "after torch.distributed.init_process_group)"
        )


def _torch_defaults(options: dict[str, Any]) -> dict[str, Any]:
    # FSDP1 needs to be told which device to run on: the rank's, by backend (CPU under gloo
    # even when CUDA is there), as for the other engines.
    options.setdefault("device_id", rank_device())
    return options


def _fsdp2_defaults(options: dict[str, Any]) -> dict[str, Any]:
    if options.get("mesh") is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    return options


def _fairscale_defaults(options: dict[str, Any]) -> dict[str, Any]:
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


def _has_units(module: nn.Module) -> bool:
    from fsdp_guide.wrap._inspect import unit_engine

    return any(unit_engine(m) is not None for m in module.modules())


def shard(
    module: nn.Module,
    engine: Engine | str = "fsdp2",
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
    refused at its first ``step()`` with :class:`~fsdp_guide.wrap.OptimizerMismatchError`:
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
            FairScale).

    Returns:
        The sharded model, a new wrapper for ``"fsdp1"`` and ``"fairscale_fsdp"`` and
        ``module`` itself (changed in place) for ``"fsdp2"``.

    Raises:
        ValueError: Unknown engine; a policy given for a model that already has units;
            ``auto_wrap_policy`` among the engine options.
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
        >>> from fsdp_guide import dist_init, find_free_port
        >>> from fsdp_guide.wrap import sharded_units
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import LayerPolicy
        >>> dist_init(0, 1, backend="gloo", master_port=find_free_port())
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> model = shard(model, engine="fsdp2", policy=LayerPolicy(Block))
        >>> sharded_units(model)
        {'': ('fsdp2', 17472), 'blocks.0': ('fsdp2', 12704), 'blocks.1': ('fsdp2', 12704)}
        >>> dist.destroy_process_group()
    """
    engine = check_engine(engine)
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
    _check_process_group("shard()")
    before = list(module.parameters())
    wrapped = _shard_with(engine, module, policy, dict(engine_options))
    if engine == "fsdp2":
        # Sharded in place, the same object returned: an optimizer built before this call
        # would step the replaced parameters with nothing to show it. FSDP1 and FairScale
        # return a new wrapper, and check_optimizer names that mistake (lesson 04 shows it).
        watch_replaced_parameters(before, wrapped, engine)
    return wrapped


def _shard_with(
    engine: Engine, module: nn.Module, policy: WrapPolicy | None, options: dict[str, Any]
) -> nn.Module:
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        options = _torch_defaults(options)
        auto_wrap_policy = policy.for_torch() if policy is not None else None
        return FullyShardedDataParallel(module, auto_wrap_policy=auto_wrap_policy, **options)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        options = _fsdp2_defaults(options)
        units = selected_modules(module, policy) if policy is not None else []
        for _, unit in units:  # children before parents, as fully_shard requires
            fully_shard(unit, **options)
        fully_shard(module, **options)
        return module
    return _shard_fairscale(module, policy, _fairscale_defaults(options))


def _shard_fairscale(
    module: nn.Module, policy: WrapPolicy | None, options: dict[str, Any]
) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.wrap import auto_wrap, enable_wrap

    if policy is not None:
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            auto_wrap_policy=policy.for_fairscale(),
            **options,
        ):
            module = auto_wrap(module)
    wrapped: nn.Module = FullyShardedDataParallel(module, **options)
    return wrapped
