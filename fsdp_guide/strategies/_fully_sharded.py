"""``DDPFullyShardedStrategy``: Lightning 2.x training on FairScale's FullyShardedDataParallel.

Parameters, gradients and optimizer state are all sharded (ZeRO stage 3). FairScale's FSDP
runs on CUDA only; on CPU the Trainer refuses the strategy when it is created and points to
:class:`~fsdp_guide.strategies.DDPShardedStrategy` or Lightning's own ``"fsdp"``.

Wrapping: ``configure_model`` (and the deprecated ``configure_sharded_model``) runs inside
FairScale's ``enable_wrap`` context, so ``fairscale.nn.wrap.wrap(layer)`` shards that layer
there and does nothing under other strategies. When nothing was wrapped by hand, the model
is auto-wrapped with a size policy (``min_num_params``). The root is always wrapped last.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.imports import _IS_INTERACTIVE
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from fsdp_guide.strategies._common import (
    check_extra_kwargs,
    notebook_start_method,
    unwrap_optimizer,
)
from fsdp_guide.strategies._fsdp_helpers import (
    apply_activation_checkpointing,
    check_optimizers_use_sharded_params,
    contains_fsdp,
    normalize_layer_classes,
)
from fsdp_guide.strategies._precision import (
    check_sharded_precision,
    shard_aware_precision_plugin,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators import Accelerator


USE_TRAINER_MODEL = (
    "configure_optimizers must build the optimizer from self.trainer.model.parameters():"
    " under DDPFullyShardedStrategy the layers are sharded before the optimizer is created"
)


class DDPFullyShardedStrategy(DDPStrategy):
    """Fully sharded data parallel training with FairScale FSDP (CUDA only).

    Args:
        accelerator: Lightning accelerator (normally chosen by the Trainer).
        cpu_offload: Keep the fp32 parameter shards on CPU (use with ``precision="16-mixed"``).
        flatten_parameters: Flatten each wrapped module's parameters into one tensor.
        reshard_after_forward: Free gathered parameters after forward (saves memory,
            gathers again in backward).
        move_grads_to_cpu: Move gradient shards to CPU after reduction; defaults to
            ``cpu_offload``.
        fp32_reduce_scatter: Reduce-scatter gradients in fp32 (mixed precision only).
        compute_dtype: dtype of the gathered parameters used in compute; by default fp32,
            or the mixed precision dtype (fp16 / bf16).
        bucket_cap_mb: Bucket size in MB for the gradient reduce-scatter; <= 0 disables.
        min_num_params: Parameter count from which auto-wrap wraps a module.
        state_dict_to_cpu: Return ``state_dict()`` tensors on CPU.
        activation_checkpointing: A layer class, or a list of them, whose instances
            recompute their activations in backward instead of storing them.
        parallel_devices: Devices of this node (normally chosen by the Trainer).
        cluster_environment: Lightning cluster environment.
        checkpoint_io: Lightning checkpoint IO plugin.
        precision_plugin: Lightning precision plugin; replaced by its shard-aware equivalent.
        process_group_backend: Process group backend; ``"nccl"`` by default on CUDA.
        timeout: Timeout of the process group's collectives.
        start_method: ``"popen"`` (default), ``"spawn"`` or ``"fork"``; in an interactive
            session ``"popen"`` cannot work and ``"fork"`` is used instead.
        **kwargs: Further FairScale ``FullyShardedDataParallel`` arguments.

    Raises:
        TypeError: For an argument FairScale FSDP does not take, or an
            ``activation_checkpointing`` that is not a module class or list of them.
        ValueError: For a negative ``min_num_params``.

    Examples:
        >>> strategy = DDPFullyShardedStrategy(cpu_offload=True, min_num_params=10_000)
        >>> strategy.move_grads_to_cpu, strategy.min_num_params
        (True, 10000)
        >>> DDPFullyShardedStrategy(offload=True)
        Traceback (most recent call last):
        ...
        TypeError: DDPFullyShardedStrategy got unknown argument(s) ['offload']; ...
    """

    strategy_name = "ddp_fully_sharded"
    # Lightning assigns the plugin it built here: it becomes shard-aware at once.
    precision_plugin = shard_aware_precision_plugin()

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        cpu_offload: bool = False,
        flatten_parameters: bool = True,
        reshard_after_forward: bool = True,
        move_grads_to_cpu: bool | None = None,
        fp32_reduce_scatter: bool | None = None,
        compute_dtype: torch.dtype | None = None,
        bucket_cap_mb: int = 25,
        min_num_params: int = 100_000_000,
        state_dict_to_cpu: bool = True,
        activation_checkpointing: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        from fairscale.nn import FullyShardedDataParallel

        check_extra_kwargs(
            kwargs,
            FullyShardedDataParallel.__init__,
            type(self).__name__,
            excluded=(
                *("self", "module", "mixed_precision", "move_params_to_cpu", "compute_device"),
                *_OWN_FSDP_ARGS,
            ),
        )
        if min_num_params < 0:
            raise ValueError(f"min_num_params must be >= 0, got {min_num_params}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.cpu_offload = cpu_offload
        self.flatten_parameters = flatten_parameters
        self.reshard_after_forward = reshard_after_forward
        self.move_grads_to_cpu = cpu_offload if move_grads_to_cpu is None else move_grads_to_cpu
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.compute_dtype = compute_dtype
        self.bucket_cap_mb = bucket_cap_mb
        self.min_num_params = min_num_params
        self.state_dict_to_cpu = state_dict_to_cpu
        self.activation_checkpointing = normalize_layer_classes(activation_checkpointing)
        self.fsdp_kwargs: dict[str, Any] = dict(kwargs)

    def _require_cuda(self) -> None:
        from pytorch_lightning.accelerators import CUDAAccelerator

        if not isinstance(self.accelerator, CUDAAccelerator):
            raise ValueError(
                "DDPFullyShardedStrategy runs FairScale's FSDP, which needs CUDA GPUs"
                f" (accelerator here: {type(self.accelerator).__name__}). On CPU use"
                " fsdp_guide.strategies.DDPShardedStrategy (strategy='ddp_sharded'), or"
                " Lightning's PyTorch FSDP (strategy='fsdp')."
            )

    def _configure_launcher(self) -> None:
        # Called when the Trainer is created: fail there, before any process starts.
        self._require_cuda()
        check_sharded_precision(self.precision_plugin)  # before any rank starts
        # In a notebook "popen" cannot work (the Trainer would refuse it): fork instead.
        self._start_method = notebook_start_method(  # type: ignore[assignment]
            self._start_method, type(self).__name__, _IS_INTERACTIVE
        )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        """Check for CUDA, then start the process group."""
        self._require_cuda()
        super().setup_environment()

    def fsdp_config(self) -> dict[str, Any]:
        """Keyword arguments given to every FairScale ``FullyShardedDataParallel`` wrapper.

        Mixed precision turns on FSDP's ``mixed_precision`` and, unless ``compute_dtype`` was
        given, computes in fp16 (``"16-mixed"``) or bf16 (``"bf16-mixed"``).

        Examples:
            >>> from pytorch_lightning.plugins.precision import MixedPrecision
            >>> strategy = DDPFullyShardedStrategy(parallel_devices=[torch.device("cpu")])
            >>> strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
            >>> config = strategy.fsdp_config()
            >>> config["mixed_precision"], config["compute_dtype"], config["bucket_cap_mb"]
            (True, torch.bfloat16, 25)
        """
        precision = getattr(self.precision_plugin, "precision", "32-true")
        mixed = precision in ("16-mixed", "bf16-mixed")
        compute_dtype = self.compute_dtype
        if compute_dtype is None and mixed:
            compute_dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        return {
            "mixed_precision": mixed,
            "move_params_to_cpu": self.cpu_offload,
            "flatten_parameters": self.flatten_parameters,
            "reshard_after_forward": self.reshard_after_forward,
            "move_grads_to_cpu": self.move_grads_to_cpu,
            "fp32_reduce_scatter": bool(self.fp32_reduce_scatter) if mixed else False,
            "compute_dtype": compute_dtype,
            "bucket_cap_mb": self.bucket_cap_mb,
            "state_dict_device": torch.device("cpu") if self.state_dict_to_cpu else None,
            "compute_device": self.root_device,
            **self.fsdp_kwargs,
        }

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """FairScale's ``enable_wrap`` with this strategy's FSDP settings and size policy."""
        from fairscale.nn import FullyShardedDataParallel, default_auto_wrap_policy, enable_wrap

        policy = functools.partial(default_auto_wrap_policy, min_num_params=self.min_num_params)
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel, auto_wrap_policy=policy, **self.fsdp_config()
        ):
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load weights into the wrapped model, which knows how to take a full state dict."""
        return True

    def setup(self, trainer: pl.Trainer) -> None:
        """Wrap the module in FSDP, then build the optimizers from the sharded parameters."""
        assert self.accelerator is not None and self.model is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        if not self.cpu_offload:
            self.model_to_device()
        self.model = self._wrap_model(self.model)
        self.precision_plugin.sharded_model = self.model
        if fitting:
            try:
                self.setup_optimizers(trainer)
            except ValueError as err:
                if "empty parameter list" in str(err):
                    raise ValueError(f"{USE_TRAINER_MODEL} ({err})") from err
                raise
            check_optimizers_use_sharded_params(
                [unwrap_optimizer(o) for o in self.optimizers],
                self.model,
                USE_TRAINER_MODEL,
                module_params=self.lightning_module.parameters(),
            )
        self.setup_precision_plugin()
        if fitting and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        from fairscale.nn import FullyShardedDataParallel, auto_wrap, wrap

        apply_activation_checkpointing(model, self.activation_checkpointing)
        with self.model_sharded_context():
            if not contains_fsdp(model):
                model = auto_wrap(model)
            if not isinstance(model, FullyShardedDataParallel):
                model = wrap(model)
        return model

    def _is_wrapped(self) -> bool:
        from fairscale.nn import FullyShardedDataParallel

        return isinstance(self.model, FullyShardedDataParallel)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients without reduce-scatter on accumulating steps."""
        if self._is_wrapped():
            assert self.model is not None
            with self.model.no_sync():  # type: ignore[operator]
                yield None
        else:
            yield None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full (gathered) model state; every rank must call it."""
        if self._is_wrapped():
            assert self.model is not None
            return dict(self.model.state_dict())
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load a full model state into the FSDP-wrapped model (each rank keeps its shard)."""
        if self._is_wrapped():
            assert self.model is not None
            self.model.load_state_dict(checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        """Gather the full optimizer state on rank 0 (collective); other ranks get ``{}``."""
        if not self._is_wrapped():
            return super().optimizer_state(optimizer)
        from fsdp_guide.engines import FairScaleFSDP

        assert self.model is not None
        # The engine's gather keeps the live optimizer's ``step`` tensors, so training can
        # go on after a save.
        full = FairScaleFSDP().full_optimizer_state(self.model, unwrap_optimizer(optimizer))
        return dict(full) if full is not None and self.is_global_zero else {}

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Give each rank its shard of the full optimizer state in the checkpoint."""
        if not self._is_wrapped():
            super().load_optimizer_state_dict(checkpoint)
            return
        assert self.model is not None
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            shard = self.model.get_shard_from_optim_state_dict(full)  # type: ignore[operator]
            unwrap_optimizer(optimizer).load_state_dict(shard)

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Nothing to prepare: FSDP registers its own backward hooks."""

    def teardown(self) -> None:
        """Release the accelerator and plugins, leaving the shards where they are.

        Lightning's default moves the module and optimizer state to CPU. FSDP shards must
        stay on their GPU: ``trainer.save_checkpoint`` after ``fit`` and the fork launcher's
        final ``state_dict`` gather them with NCCL, which needs CUDA tensors (Lightning's
        own ``FSDPStrategy`` skips the move for the same reason).
        """
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Add ``ddp_fully_sharded`` (never ``fsdp``: Lightning uses it for PyTorch FSDP)."""
        strategy_registry.register(
            "ddp_fully_sharded",
            cls,
            description="FairScale FullyShardedDataParallel (CUDA only)",
            override=True,
        )


# FSDP arguments this strategy exposes under its own (seed API) names.
_OWN_FSDP_ARGS = (
    "cpu_offload",
    "flatten_parameters",
    "reshard_after_forward",
    "move_grads_to_cpu",
    "fp32_reduce_scatter",
    "compute_dtype",
    "bucket_cap_mb",
    "state_dict_device",
)
