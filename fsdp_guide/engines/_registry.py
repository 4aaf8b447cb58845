"""The engines by name, and the one way to get an engine: :func:`engine_for` (private module)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fsdp_guide.catalog import StrategySpec, check_strategies, get_strategy
from fsdp_guide.engines._base import Built, Engine
from fsdp_guide.engines._units import UNIT_RULES, UnitEngine, UnitView
from fsdp_guide.engines.ddp import DDP
from fsdp_guide.engines.deepspeed import DeepSpeedZero
from fsdp_guide.engines.fairscale_fsdp import FairScaleFSDP
from fsdp_guide.engines.fsdp1 import FSDP1
from fsdp_guide.engines.fsdp2 import FSDP2
from fsdp_guide.engines.oss import OSS
from fsdp_guide.engines.plain import Plain
from fsdp_guide.engines.sharded_ddp import ShardedDDP
from fsdp_guide.engines.zero1 import Zero1

#: Every engine, in the order :func:`engine_for` asks them about a model: wrappers of
#: wrappers first (a DeepSpeed engine, FSDP), the optimizer-only ones (OSS, ZeRO) before DDP,
#: which they wrap.
ENGINES: tuple[type[Engine], ...] = (
    DeepSpeedZero,
    FairScaleFSDP,
    FSDP2,
    FSDP1,
    ShardedDDP,
    OSS,
    Zero1,
    DDP,
    Plain,
)
_BY_NAME: dict[str, type[Engine]] = {
    name: cls for cls in ENGINES for name in (cls.name, *cls.aliases)
}
#: The tensors any engine hangs on a parameter that hold its data, or a gradient shard.
PARAM_BUFFERS: tuple[str, ...] = tuple(dict.fromkeys(n for e in ENGINES for n in e.param_buffers))
GRAD_BUFFERS: tuple[str, ...] = tuple(dict.fromkeys(n for e in ENGINES for n in e.grad_buffers))


def engine_for(source: str | StrategySpec | nn.Module, optimizer: object = None) -> Engine:
    """The engine of a strategy, or of a model that an engine wrapped.

    Args:
        source: A strategy: its name (or an alias) in :data:`fsdp_guide.catalog.STRATEGIES`,
            or its row; the engine it runs on comes configured with the strategy's settings.
            Or a model: the engine that wrapped it, read from its type and its optimizer's
            (FairScale and DeepSpeed types are recognised only once those libraries were
            imported; a model no engine wrapped is the ``"module"`` engine).
        optimizer: With a model, its optimizer (OSS, ``ZeroRedundancyOptimizer`` and
            DeepSpeed are told apart by it).

    Raises:
        ValueError: For an unknown strategy.
        TypeError: For an optimizer given with a strategy, or a source of another type.

    Examples:
        >>> engine = engine_for("fsdp_grad_op")
        >>> engine.name, engine.sharding_strategy
        ('fsdp1', 'SHARD_GRAD_OP')
        >>> engine = engine_for("deepspeed_zero2_offload")
        >>> type(engine).__name__, engine.stage, engine.offload_optimizer, engine.offload_params
        ('DeepSpeedZero', 2, True, False)
        >>> engine_for(nn.Linear(2, 2)).name
        'module'
    """
    if isinstance(source, nn.Module):
        for cls in ENGINES:
            if cls.recognises(source, optimizer):
                return cls.from_model(source, optimizer)
        raise AssertionError("Plain recognises every model")  # pragma: no cover
    if optimizer is not None:
        raise TypeError("engine_for takes an optimizer with a model only, not with a strategy")
    if not isinstance(source, str | StrategySpec):
        raise TypeError(
            f"engine_for takes a strategy name, a StrategySpec or a model, got "
            f"{type(source).__name__}"
        )
    spec = source if isinstance(source, StrategySpec) else get_strategy(source)
    return engine_class(spec.engine)(**spec.settings)


# What the other sub-packages need besides engine_for (importable from the façade, not in
# its __all__): the adapter class of an engine named in a checkpoint, the unit-sharding
# engine a wrap asks for, what unit a module is, and a strategy's engine built in a rank.


def engine_class(name: str) -> type[Engine]:
    """The adapter class of the engine called ``name`` (or an older spelling).

    Raises:
        ValueError: For an unknown name.

    Examples:
        >>> engine_class("fsdp2").sharded_layout, engine_class("deepspeed").saves_full
        ('dcp', False)
        >>> engine_class("zero3")
        Traceback (most recent call last):
        ...
        ValueError: unknown engine 'zero3'; choose one of 'deepspeed', 'fairscale_fsdp', ...
    """
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        choices = ", ".join(repr(e.name) for e in ENGINES)
        raise ValueError(f"unknown engine {name!r}; choose one of {choices}")
    return cls


#: The engines that shard a model unit by unit (FSDP), in catalog order.
UNIT_ENGINES: tuple[type[UnitEngine], ...] = (FSDP1, FSDP2, FairScaleFSDP)


def unit_engine(name: object) -> UnitEngine:
    """The unit-sharding engine called ``name``, checked against this machine.

    Raises:
        ValueError: For a name that is not a unit-sharding engine.
        EngineUnavailableError: For one that cannot run here (FairScale FSDP without CUDA).

    Examples:
        >>> unit_engine("torch").name
        'fsdp1'
        >>> unit_engine("deepspeed")
        Traceback (most recent call last):
        ...
        ValueError: unknown engine 'deepspeed'; choose one of 'fsdp1', 'fsdp2', 'fairscale_fsdp'
    """
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None or not issubclass(cls, UnitEngine):
        choices = ", ".join(repr(e.name) for e in UNIT_ENGINES)
        raise ValueError(f"unknown engine {name!r}; choose one of {choices}")
    engine = cls()
    engine.check_available()
    return engine


def unit_of(module: nn.Module) -> tuple[str, UnitView] | None:
    """``(engine name, what is inside)`` when ``module`` is a unit of an FSDP engine.

    Examples:
        >>> unit_of(nn.Linear(2, 2)) is None
        True
    """
    for cls in UNIT_ENGINES:
        view = cls.unit(module)
        if view is not None:
            return cls.name, view
    return None


def wrap_for_strategy(
    model: nn.Module, strategy: str, world_size: int, lr: float = 1e-3, wrap: str = "blocks"
) -> Built:
    """Wrap ``model`` for ``strategy`` and build its Adam optimizer, inside a launched rank.

    The process group must be up (:func:`fsdp_guide.launch` does that). On NCCL the model
    moves to this rank's GPU; on gloo it stays on CPU.

    Args:
        model: The model, identical on every rank.
        strategy: A name (or alias) from :data:`fsdp_guide.catalog.STRATEGIES`.
        world_size: Number of ranks.
        lr: Adam's learning rate.
        wrap: How a fully sharded strategy cuts the model into units: ``"blocks"`` (a unit
            per transformer block) or ``"root"``
            (the whole model one unit); the other strategies have no units.

    Returns:
        The module to train and its optimizer.

    Raises:
        ValueError: For an unknown strategy or wrap, or a CUDA-only one without CUDA.

    Examples:
        >>> wrap_for_strategy(nn.Linear(2, 2), "zero4", 1)
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero4'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    from fsdp_guide.launcher import rank_device

    (spec,) = check_strategies([strategy])
    engine = with_wrap(engine_for(spec), wrap)
    device = torch.device("cuda", torch.cuda.current_device()) if spec.needs_cuda else rank_device()
    return engine.build(model.to(device), device=device, world_size=world_size, lr=lr)


def with_wrap(engine: Engine, wrap: str) -> Engine:
    """``engine`` cutting a model into units by ``wrap`` (``"blocks"`` or ``"root"``), where it
    makes units (FSDP1, FSDP2); any other engine unchanged.

    Raises:
        ValueError: For another ``wrap``.

    Examples:
        >>> with_wrap(FSDP2(), "root").wrap, with_wrap(DDP(), "root")
        ('root', DDP(gradient_as_bucket_view=True))
    """
    if wrap not in UNIT_RULES:
        raise ValueError(f"unknown wrap {wrap!r}; choose one of {', '.join(UNIT_RULES)}")
    if isinstance(engine, FSDP1 | FSDP2):
        return replace(engine, wrap=wrap)  # type: ignore[arg-type]
    return engine
