"""``DDPShardedStrategy``: Lightning 2.x data parallel training on FairScale OSS + ShardedDDP.

Each rank keeps the full model but only its shard of the optimizer state (ZeRO stage 1) and,
through ShardedDataParallel, only the reduced gradients of its shard (stage 2). During
``fit`` the strategy rebuilds every optimizer returned by ``configure_optimizers`` as
FairScale's ``OSS`` around the same optimizer class, hyper-parameters and param
groups, points the LR schedulers at it, then wraps the module in
FairScale's ``ShardedDataParallel``. ``validate``, ``test`` and
``predict`` run the plain module, as with Lightning's DDP.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.imports import _IS_INTERACTIVE
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.overrides.distributed import _sync_module_states
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from fsdp_guide.strategies._common import (
    check_extra_kwargs,
    constructor_defaults,
    notebook_start_method,
    retarget_schedulers,
    unwrap_optimizer,
)
from fsdp_guide.strategies._precision import (
    check_sharded_precision,
    shard_aware_precision_plugin,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators import Accelerator


log = logging.getLogger(__name__)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


def _keep_bucket_views_on_zero_grad(optimizer: Optimizer, sharded_ddp: Any) -> None:
    """Make ``optimizer.zero_grad()`` zero bucketed gradients in place instead of dropping them.

    ShardedDDP packs small gradients into reduce buckets: their ``.grad`` are views of a bucket
    buffer. torch's default ``zero_grad(set_to_none=True)`` (what Lightning calls) would
    replace those views with fresh tensors that the bucket never reduces, silently training
    on local gradients. Bucketed gradients are therefore zeroed in place; the others follow
    ``set_to_none``.
    """

    def zero_grad(set_to_none: bool = True) -> None:
        # ShardedDDP sets these up at its first training forward and on trainability changes.
        flags = getattr(sharded_ddp, "_should_bucket_grad", [])
        params = getattr(sharded_ddp, "_trainable_params", [])
        bucketed = {id(p) for p, flag in zip(params, flags, strict=False) if flag}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none and id(param) not in bucketed:
                    param.grad = None
                else:
                    param.grad.zero_()

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


class DDPShardedStrategy(DDPStrategy):
    """Optimizer state and gradient sharding (FairScale OSS + ShardedDDP) for Lightning 2.x.

    Runs on CPU (gloo) and GPUs (NCCL). Precision: ``"32-true"``, ``"bf16-mixed"`` (CPU and
    CUDA) and ``"16-mixed"`` (CUDA, with FairScale's ``ShardedGradScaler``). Gradient
    clipping by norm is computed across shards by OSS; gradient accumulation skips the
    reduction on accumulating steps.

    Args:
        accelerator: Lightning accelerator (normally chosen by the Trainer).
        parallel_devices: Devices of this node (normally chosen by the Trainer).
        cluster_environment: Lightning cluster environment.
        checkpoint_io: Lightning checkpoint IO plugin.
        precision_plugin: Lightning precision plugin; replaced by its shard-aware equivalent.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default from the device.
        timeout: Timeout of the process group's collectives.
        start_method: How ranks start: ``"popen"`` re-runs the script (the default, like
            Lightning's ``"ddp"``), ``"spawn"``, or ``"fork"`` (notebooks). In an
            interactive session ``"popen"`` cannot work and ``"fork"`` is used instead.
        find_unused_parameters: ``None`` (not given) or ``False``, what Lightning 1.x's
            ``"ddp_sharded_find_unused_parameters_false"`` passed: ShardedDDP never looks
            for unused parameters. Given, it is kept in the strategy's DDP keyword arguments
            (``_ddp_kwargs``), as 1.x kept it, and not passed on to ShardedDDP, which has no
            such argument.
        **kwargs: Passed to FairScale's ``ShardedDataParallel``
            (``broadcast_buffers``, ``reduce_buffer_size``, ``reduce_fp16``, ...). Unless
            given, ``reduce_buffer_size`` is ``0`` on one node (no reduce buckets: each
            gradient goes to its shard's owner as soon as it is ready, as in Lightning
            1.6-1.9) and ``2**23`` elements on several nodes, where bucketing pays.

    Raises:
        TypeError: For a keyword argument ShardedDataParallel does not take.
        ValueError: For ``find_unused_parameters=True``.

    Examples:
        >>> strategy = DDPShardedStrategy(reduce_buffer_size=0)
        >>> strategy.strategy_name, strategy.sharded_ddp_kwargs
        ('ddp_sharded', {'reduce_buffer_size': 0})
        >>> DDPShardedStrategy(find_unused_parameters=False)._ddp_kwargs
        {'find_unused_parameters': False}
        >>> DDPShardedStrategy().sharded_ddp_options()
        {'reduce_buffer_size': 0}
        >>> strategy = DDPShardedStrategy()
        >>> strategy.num_nodes = 2  # what Trainer(num_nodes=2) sets
        >>> strategy.sharded_ddp_options()
        {'reduce_buffer_size': 8388608}
        >>> DDPShardedStrategy(broadcast_buffer=False)
        Traceback (most recent call last):
        ...
        TypeError: DDPShardedStrategy got unknown argument(s) ['broadcast_buffer']; ...
    """

    strategy_name = "ddp_sharded"
    # Lightning assigns the plugin it built here: it becomes shard-aware at once.
    precision_plugin = shard_aware_precision_plugin()
    # Lightning 1.x's _REDUCE_BUFFER_SIZE_DEFAULT: ShardedDDP's buckets, for several nodes.
    REDUCE_BUFFER_SIZE_MULTI_NODE = 2**23

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        find_unused_parameters: bool | None = None,
        **kwargs: Any,
    ) -> None:
        from fairscale.nn.data_parallel import ShardedDataParallel

        if find_unused_parameters:
            raise ValueError(
                f"{type(self).__name__}: ShardedDataParallel cannot look for unused parameters "
                "(find_unused_parameters=True); every trainable parameter must get a gradient "
                "each step. Freeze the parameters a step does not use, or use Lightning's "
                "strategy='ddp_find_unused_parameters_true'"
            )
        check_extra_kwargs(
            kwargs,
            ShardedDataParallel.__init__,
            type(self).__name__,
            excluded=("self", "module", "sharded_optimizer", "process_group"),
        )
        # Lightning 1.x's *_find_unused_parameters_false names passed it explicitly, and their
        # DDP keyword arguments showed it; ShardedDDP never looks, so it goes no further.
        ddp_kwargs: dict[str, Any] = {}
        if find_unused_parameters is not None:
            ddp_kwargs["find_unused_parameters"] = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self.sharded_ddp_kwargs: dict[str, Any] = dict(kwargs)

    def _configure_launcher(self) -> None:
        check_sharded_precision(self.precision_plugin)  # before any rank starts
        self._start_method = notebook_start_method(  # type: ignore[assignment]
            self._start_method, type(self).__name__, _IS_INTERACTIVE
        )
        super()._configure_launcher()

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the module to the device; when fitting, shard optimizers and wrap the module."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)

        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()

        if fitting:
            # OSS must exist before ShardedDDP, which registers its reduce hooks per shard.
            self.setup_optimizers(trainer)
            self._rebuild_optimizers_as_oss()
            self.configure_ddp()
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _rebuild_optimizers_as_oss(self) -> None:
        from fairscale.optim import OSS

        sharded: list[Optimizer] = []
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        for optimizer in self.optimizers:
            plain = unwrap_optimizer(optimizer)
            if isinstance(plain, OSS):
                sharded.append(plain)
                continue
            groups = [dict(group) for group in plain.param_groups]
            oss = OSS(params=groups, optim=type(plain), **constructor_defaults(plain))
            retarget_schedulers(schedulers, plain, oss)
            sharded.append(oss)
        self.optimizers = sharded

    def configure_ddp(self) -> None:
        """Wrap the LightningModule in ShardedDataParallel around this rank's OSS optimizers."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        assert self.model is not None
        sharded_ddp = ShardedDataParallel(
            self.model, sharded_optimizer=list(self.optimizers), **self.sharded_ddp_options()
        )
        for optimizer in self.optimizers:
            _keep_bucket_views_on_zero_grad(optimizer, sharded_ddp)
        self.model = sharded_ddp

    def sharded_ddp_options(self) -> dict[str, Any]:
        """The keyword arguments ShardedDataParallel gets: the user's, with Lightning 1.x's default.

        Returns:
            ``sharded_ddp_kwargs`` with ``reduce_buffer_size`` set, unless the user gave it,
            to ``0`` on one node and ``2**23`` on several.
        """
        options = dict(self.sharded_ddp_kwargs)
        options.setdefault(
            "reduce_buffer_size", self.REDUCE_BUFFER_SIZE_MULTI_NODE if self.num_nodes > 1 else 0
        )
        return options

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally: ShardedDDP skips its reduce calls inside."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        if isinstance(self.model, ShardedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """The full optimizer state, consolidated from the OSS shards on every rank.

        A collective: every rank must call it (Lightning's ``save_checkpoint`` does). Each
        rank gets the same full state, so a callback reading it sees the whole optimizer on
        any rank; Lightning still writes the checkpoint once, from global rank 0.
        """
        from fairscale.optim import OSS

        plain = unwrap_optimizer(optimizer)
        if not isinstance(plain, OSS):
            return super().optimizer_state(optimizer)
        plain.consolidate_state_dict(recipient_rank=-1)  # -1: materialise on every rank
        state: dict[str, Tensor] = plain.state_dict()
        return state

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Nothing to prepare: ShardedDDP hooks are installed at its first training forward."""

    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing to flush: ShardedDDP flushes its reductions at the end of backward."""

    def teardown(self) -> None:
        """Unwrap the module, then let Lightning release devices and the process group."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        if isinstance(self.model, ShardedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Add ``ddp_sharded``, its ``_fork``/``_notebook`` variants and a Lightning 1.x name.

        ``"ddp_sharded_find_unused_parameters_false"`` is Lightning 1.x's name for the same
        strategy; the ``_spawn`` names belong to
        :class:`~fsdp_guide.strategies.DDPSpawnShardedStrategy`.
        """
        for name, start_method in (
            ("ddp_sharded", "popen"),
            ("ddp_sharded_fork", "fork"),
            ("ddp_sharded_notebook", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"FairScale OSS + ShardedDDP, ranks started with {start_method!r}",
                override=True,
                start_method=start_method,
            )
        strategy_registry.register(
            "ddp_sharded_find_unused_parameters_false",
            cls,
            description="Lightning 1.x's name of 'ddp_sharded' (ShardedDDP never looks for "
            "unused parameters)",
            override=True,
            find_unused_parameters=False,
        )
