"""``DDPSpawnShardedStrategy``: Lightning 1.x's name for sharded training with spawned ranks.

Lightning 1.x had a ``DDPSpawnStrategy`` and, on top of it, ``DDPSpawnShardedStrategy``.
Lightning 2.x folded spawning into ``DDPStrategy(start_method="spawn")``: ``"ddp_spawn"`` is
the same class as ``"ddp"``, whose launcher starts each rank with
``torch.multiprocessing.start_processes(..., start_method="spawn")`` (a fresh interpreter
that imports the training script by name) instead of re-running the script. This class is
:class:`~fsdp_guide.strategies.DDPShardedStrategy` with that start method, under the 1.x
name, so 1.x code that imports or names it runs unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.strategies.registry import _StrategyRegistry
from pytorch_lightning.plugins.precision import Precision
from torch.distributed.constants import default_pg_timeout

from fsdp_guide.strategies._sharded import DDPShardedStrategy, StartMethod

if TYPE_CHECKING:
    from pytorch_lightning.accelerators import Accelerator


class DDPSpawnShardedStrategy(DDPShardedStrategy):
    """:class:`~fsdp_guide.strategies.DDPShardedStrategy` with ranks started by spawn.

    Spawned ranks cannot run functions defined in a notebook: there, use
    ``strategy="ddp_sharded_notebook"`` (fork).

    Args:
        accelerator: Lightning accelerator (normally chosen by the Trainer).
        parallel_devices: Devices of this node (normally chosen by the Trainer).
        cluster_environment: Lightning cluster environment.
        checkpoint_io: Lightning checkpoint IO plugin.
        precision_plugin: Lightning precision plugin; replaced by its shard-aware equivalent.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default from the device.
        timeout: Timeout of the process group's collectives.
        start_method: ``"spawn"``; ``"fork"`` and ``"forkserver"`` are accepted too, as
            Lightning's own spawn launcher accepts them.
        find_unused_parameters: ``None`` or ``False`` (see
            :class:`~fsdp_guide.strategies.DDPShardedStrategy`).
        **kwargs: Passed to FairScale's ``ShardedDataParallel``.

    Raises:
        ValueError: For ``start_method="popen"``: that is ``DDPShardedStrategy``.

    Examples:
        >>> strategy = DDPSpawnShardedStrategy()
        >>> strategy.strategy_name, strategy._start_method
        ('ddp_sharded_spawn', 'spawn')
    """

    strategy_name = "ddp_sharded_spawn"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "spawn",
        find_unused_parameters: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if start_method == "popen":
            raise ValueError(
                "DDPSpawnShardedStrategy starts its ranks with spawn; for ranks that re-run "
                "the script use DDPShardedStrategy (strategy='ddp_sharded')"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            find_unused_parameters=find_unused_parameters,
            **kwargs,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Add ``ddp_sharded_spawn`` and Lightning 1.x's ``..._find_unused_parameters_false``."""
        strategy_registry.register(
            "ddp_sharded_spawn",
            cls,
            description="FairScale OSS + ShardedDDP, ranks started with 'spawn'",
            override=True,
        )
        strategy_registry.register(
            "ddp_sharded_spawn_find_unused_parameters_false",
            cls,
            description="Lightning 1.x's name of 'ddp_sharded_spawn' (ShardedDDP never looks "
            "for unused parameters)",
            override=True,
            find_unused_parameters=False,
        )
