"""Lightning 2.x strategies on FairScale: ``DDPShardedStrategy`` and ``DDPFullyShardedStrategy``.

Importing this package imports Lightning and FairScale (the strategies subclass Lightning's
``DDPStrategy``), so ``import fsdp_guide`` does not import it. On import it registers the
strategy names in Lightning's registry (:data:`STRATEGY_NAMES`):

- ``"ddp_sharded"``: :class:`DDPShardedStrategy` (OSS + ShardedDDP), ranks re-run the script;
  in a notebook it starts them with fork.
- ``"ddp_sharded_notebook"`` / ``"ddp_sharded_fork"``: the same, ranks forked (notebooks).
- ``"ddp_sharded_spawn"``: :class:`DDPSpawnShardedStrategy`, the same with ranks spawned
  (Lightning 1.x's class name; in Lightning 2.x spawning is a start method of one class).
- ``"ddp_fully_sharded"``: :class:`DDPFullyShardedStrategy` (FairScale FSDP, CUDA only).
- Lightning 1.x's ``"ddp_sharded_find_unused_parameters_false"`` and
  ``"ddp_sharded_spawn_find_unused_parameters_false"``: the first two (ShardedDDP never
  looks for unused parameters).

Lightning's documentation: `strategies <https://lightning.ai/docs/pytorch/stable/extensions/strategy.html>`__;
its own PyTorch FSDP strategy, `FSDPStrategy
<https://lightning.ai/docs/pytorch/stable/api/lightning.pytorch.strategies.FSDPStrategy.html>`__.
:class:`CPUFSDPStrategy` (no registered name) is that ``FSDPStrategy`` (PyTorch FSDP1) made
to run on CPU ranks, a teaching aid for machines without a GPU.
"""

from __future__ import annotations

from fsdp_guide.strategies._fsdp_on_cpu import CPUFSDPStrategy
from fsdp_guide.strategies._fully_sharded import DDPFullyShardedStrategy
from fsdp_guide.strategies._precision import ShardedMixedPrecision
from fsdp_guide.strategies._precision import ShardedPrecision as ShardedPrecision
from fsdp_guide.strategies._registry import STRATEGY_NAMES
from fsdp_guide.strategies._registry import (
    register_fairscale_strategies as register_fairscale_strategies,
)
from fsdp_guide.strategies._sharded import DDPShardedStrategy
from fsdp_guide.strategies._sharded_spawn import DDPSpawnShardedStrategy

__all__ = [
    "STRATEGY_NAMES",
    "CPUFSDPStrategy",
    "DDPFullyShardedStrategy",
    "DDPShardedStrategy",
    "DDPSpawnShardedStrategy",
    "ShardedMixedPrecision",
]

register_fairscale_strategies()
