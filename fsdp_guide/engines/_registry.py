"""The engines by name, the engine of a strategy, and the engine of a trained model (private)."""

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

#: Every engine, in the order :func:`detect` asks them: wrappers of wrappers first (a
#: DeepSpeed engine, FSDP), the optimizer-only ones (OSS, ZeRO) before DDP, which they wrap.
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


def engine_class(name: str) -> type[Engine]:
    """The adapter class of the engine called ``name`` (or an older spelling).

    Raises:
        ValueError: For an unknown name.

    Examples:
        >>> engine_class("fsdp2").sharded_layout, engine_class("deepspeed").saves_full
        ('dcp', False)
    """
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        choices = ", ".join(repr(e.name) for e in ENGINES)
        raise ValueError(f"unknown engine {name!r}; choose one of {choices}")
    return cls


def get_engine(name: str, **settings: object) -> Engine:
    """The engine called ``name`` (or an older spelling), configured with ``settings``.

    Raises:
        ValueError: For an unknown name.
        TypeError: For a setting the engine does not have.

    Examples:
        >>> get_engine("fsdp1", sharding_strategy="NO_SHARD").stage_at_step
        0
        >>> get_engine("zero3")
        Traceback (most recent call last):
        ...
        ValueError: unknown engine 'zero3'; choose one of 'deepspeed', 'fairscale_fsdp', ...
    """
    return engine_class(name)(**settings)


def engine_for(strategy: str | StrategySpec) -> Engine:
    """The engine a strategy runs on, configured with the strategy's settings.

    Raises:
        ValueError: For an unknown strategy.

    Examples:
        >>> engine = engine_for("fsdp_grad_op")
        >>> engine.sharding_strategy, engine.shard_group
        ('SHARD_GRAD_OP', None)
        >>> engine = engine_for("deepspeed_zero2_offload")
        >>> type(engine).__name__, engine.stage, engine.offload_optimizer, engine.offload_params
        ('DeepSpeedZero', 2, True, False)
    """
    spec = strategy if isinstance(strategy, StrategySpec) else get_strategy(strategy)
    return get_engine(spec.engine, **spec.settings)


def detect(model: nn.Module, optimizer: object = None) -> Engine:
    """The engine that built ``model`` and ``optimizer``, read from their types.

    FairScale and DeepSpeed types are recognised only once those libraries were imported
    (an object of theirs cannot exist before). A model no engine wrapped is :class:`Plain`.

    Examples:
        >>> detect(nn.Linear(2, 2)).name
        'module'
    """
    for cls in ENGINES:
        if cls.recognises(model, optimizer):
            return cls.from_model(model, optimizer)
    raise AssertionError("Plain recognises every model")  # pragma: no cover


def unit_engines() -> tuple[type[UnitEngine], ...]:
    """The engines that shard a model unit by unit (FSDP), in catalog order.

    Examples:
        >>> [e.name for e in unit_engines()]
        ['fsdp1', 'fsdp2', 'fairscale_fsdp']
    """
    order = (FSDP1, FSDP2, FairScaleFSDP)
    assert {e for e in ENGINES if issubclass(e, UnitEngine)} == set(order)
    return order


def get_unit_engine(name: object) -> UnitEngine:
    """The unit-sharding engine called ``name``, checked against this machine.

    Raises:
        ValueError: For a name that is not a unit-sharding engine.
        EngineUnavailableError: For one that cannot run here (FairScale FSDP without CUDA).

    Examples:
        >>> get_unit_engine("torch").name
        'fsdp1'
        >>> get_unit_engine("deepspeed")
        Traceback (most recent call last):
        ...
        ValueError: unknown engine 'deepspeed'; choose one of 'fsdp1', 'fsdp2', 'fairscale_fsdp'
    """
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None or not issubclass(cls, UnitEngine):
        choices = ", ".join(repr(e.name) for e in unit_engines())
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
    for cls in unit_engines():
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
            per transformer block, :func:`~fsdp_guide.engines.block_classes`) or ``"root"``
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
