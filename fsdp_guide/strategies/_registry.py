"""Registration of the FairScale strategies in Lightning's ``StrategyRegistry``.

Importing :mod:`fsdp_guide.strategies` calls :func:`register_fairscale_strategies` once, so
``Trainer(strategy="ddp_sharded")`` works right after the import. Calling it again is
harmless. The name ``"fsdp"`` is never taken: Lightning 2.x uses it for PyTorch's FSDP.
"""

from __future__ import annotations

from typing import Any

#: The strategy names registered in Lightning's registry, Lightning 1.x's names included.
STRATEGY_NAMES = (
    "ddp_sharded",
    "ddp_sharded_spawn",
    "ddp_sharded_fork",
    "ddp_sharded_notebook",
    "ddp_fully_sharded",
    # Lightning 1.x's names, kept so that 1.x scripts run unchanged.
    "ddp_sharded_find_unused_parameters_false",
    "ddp_sharded_spawn_find_unused_parameters_false",
)


def register_fairscale_strategies(registry: Any = None) -> list[str]:
    """Register the FairScale strategies under ``STRATEGY_NAMES``.

    Args:
        registry: A Lightning ``_StrategyRegistry``; Lightning's global one by default.

    Returns:
        The names now registered.

    Raises:
        ValueError: When one of the names already belongs to another strategy class.

    Examples:
        >>> from lightning_fabric.strategies import _StrategyRegistry
        >>> registry = _StrategyRegistry()
        >>> register_fairscale_strategies(registry)  # doctest: +NORMALIZE_WHITESPACE
        ['ddp_sharded', 'ddp_sharded_spawn', 'ddp_sharded_fork', 'ddp_sharded_notebook',
         'ddp_fully_sharded', 'ddp_sharded_find_unused_parameters_false',
         'ddp_sharded_spawn_find_unused_parameters_false']
        >>> registry.get("ddp_sharded_notebook")._start_method
        'fork'
    """
    from fsdp_guide.strategies._fully_sharded import DDPFullyShardedStrategy
    from fsdp_guide.strategies._sharded import DDPShardedStrategy
    from fsdp_guide.strategies._sharded_spawn import DDPSpawnShardedStrategy

    if registry is None:
        from pytorch_lightning.strategies import StrategyRegistry

        registry = StrategyRegistry
    ours = (DDPShardedStrategy, DDPSpawnShardedStrategy, DDPFullyShardedStrategy)
    for name in STRATEGY_NAMES:
        if name in registry and registry[name]["strategy"] not in ours:
            raise ValueError(
                f"strategy name {name!r} is already registered for"
                f" {registry[name]['strategy'].__name__}; remove it from the registry first"
            )
    for cls in ours:
        cls.register_strategies(registry)
    return [name for name in STRATEGY_NAMES if name in registry]
