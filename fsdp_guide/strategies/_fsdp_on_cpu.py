"""Lightning's own ``FSDPStrategy`` on CPU ranks, to learn and test: :class:`CPUFSDPStrategy`.

Lightning 2.x runs PyTorch's FSDP1 only on GPUs. Its ``FSDPStrategy`` refuses a CPU
accelerator when the ``Trainer`` is built (for its registered names and for the class
itself), and a subclass that passes that check fails later, on every rank: Lightning gives
FSDP1 ``device_id=None`` on CPU, and FSDP1 then asks for "a non-CPU accelerator device".
PyTorch's FSDP1 itself runs on CPU with gloo when told ``device_id=torch.device("cpu")``.

:class:`CPUFSDPStrategy` changes four things, only on CPU ranks, and nothing on a GPU:

* FSDP1 is given the CPU as its device, in auto wrapping and in manual wrapping
  (``torch.distributed.fsdp.wrap.wrap`` inside ``configure_model``);
* a ``device_mesh`` given as a tuple (``HYBRID_SHARD``) is built on the CPU, not on CUDA;
* ``state_dict_type="full"`` gathers the full state without ``offload_to_cpu``: on CPU
  that copy is a no-op, and the gathered tensors would alias storage FSDP1 frees right
  after (the rank dies of a segmentation fault while saving);
* ``cpu_offload`` is refused when the ``Trainer`` is built: the parameters already live
  in CPU memory, and FSDP1's offload pins memory, which needs an accelerator.

Everything else (sharding strategies, wrap and activation-checkpointing policies, mixed
precision, ``use_orig_params``, sharded checkpoints, ``configure_model``) is Lightning's
own code. It is a teaching aid: train on GPUs with Lightning's ``FSDPStrategy``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch.nn import Module
from torch.optim import Optimizer

from fsdp_guide.errors import EngineUnavailableError


def _is_fsdp1(module: Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (PyTorch FSDP1), able to train on CPU ranks with gloo.

    It takes the same arguments as ``pytorch_lightning.strategies.FSDPStrategy`` and behaves
    the same, except on CPU ranks, where FSDP1 is told to compute on the CPU, a
    ``device_mesh`` tuple is built on the CPU, full checkpoints are gathered without the
    offload to CPU (a no-op there, whose gathered tensors would alias storage FSDP1 frees
    right after: the rank dies saving), and ``cpu_offload`` is refused when the ``Trainer``
    is built (the shards are in CPU memory already, and FSDP1's offload needs an
    accelerator to pin memory). On a GPU it is ``FSDPStrategy``. It has no registered name: pass an
    instance, ``Trainer(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(...))``.

    Like ``FSDPStrategy``, it starts the other ranks by running the script again. In a
    notebook, build and fit the ``Trainer`` inside a function run by
    :func:`fsdp_guide.launch`: Lightning then finds the process group already made, as
    under ``torchrun``.

    Examples:
        The constructor is Lightning's; the class passes Lightning's CPU check because it
        is a subclass:

        >>> from fsdp_guide.models import Block
        >>> strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP")
        >>> strategy.sharding_strategy.name, strategy.kwargs["use_orig_params"]
        ('SHARD_GRAD_OP', True)
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        >>> trainer.strategy is strategy
        True
    """

    def _on_cpu(self) -> bool:
        return self.parallel_devices is not None and self.root_device.type == "cpu"

    def _configure_launcher(self) -> None:
        # The Trainer calls this while it is built, once the devices are known: a setting
        # that cannot run here fails now, before any rank starts.
        if self._on_cpu() and self.cpu_offload is not None and self.cpu_offload.offload_params:
            raise EngineUnavailableError(
                "cpu_offload moves FSDP's parameter shards from an accelerator to CPU memory; "
                "on CPU ranks they are there already, and FSDP1's offload pins memory, which "
                "needs an accelerator. Leave cpu_offload unset on CPU (it pays off on GPUs)"
            )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        mesh_shape = self.kwargs.get("device_mesh")
        if not (self._on_cpu() and isinstance(mesh_shape, tuple)):
            super().setup_environment()
            return
        # Lightning builds a tuple's mesh on CUDA; build it on the CPU after joining the group.
        del self.kwargs["device_mesh"]
        try:
            super().setup_environment()
        finally:
            self.kwargs["device_mesh"] = mesh_shape
        from torch.distributed.device_mesh import init_device_mesh

        self.kwargs["device_mesh"] = init_device_mesh("cpu", mesh_shape)

    def _setup_model(self, model: Module) -> Module:
        if not self._on_cpu() or _is_fsdp1(model):
            return super()._setup_model(model)
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,  # Lightning passes root_device.index: None on CPU
            **self.kwargs,
        )
        # Lightning finishes an already wrapped model (activation checkpointing, metrics);
        # it would drop a policy it finds set, with a warning, so it is held back meanwhile.
        policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            return super()._setup_model(wrapped)
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        if not self._on_cpu():
            with super().model_sharded_context():
                yield
            return
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        ):
            yield

    def _full_state_dict_context(self) -> Any:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.api import FullOptimStateDictConfig

        assert self.model is not None
        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not (self._on_cpu() and self._state_dict_type == "full"):
            return super().lightning_module_state_dict()
        assert self.model is not None
        with self._full_state_dict_context():
            state: dict[str, Any] = self.model.state_dict()
            return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        if not (self._on_cpu() and self._state_dict_type == "full"):
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        assert self.model is not None
        with self._full_state_dict_context():
            state: dict[str, Any] = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter index, as a plain optimizer's
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state
