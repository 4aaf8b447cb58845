"""The strategies that ``compare`` runs, and how each one wraps a model and its optimizer.

Every strategy trains the same model with Adam on the same data; what differs is which
part of the model state each rank keeps. :data:`STRATEGIES` records, for each one, its
textbook ZeRO stage and the state it really holds at the measuring point (after
``optimizer.step()``, before ``zero_grad()``), which is what the prediction uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide.memory._state import ModelState
from fsdp_guide.memory._zero import estimate_model_state

Wrapped = tuple[nn.Module, torch.optim.Optimizer]


@dataclass(frozen=True)
class StrategySpec:
    """One way to train data-parallel, and the ZeRO state it holds.

    Attributes:
        name: Name on the command line.
        summary: What it is, in a few words.
        zero_stage: Its ZeRO stage in the textbook sense.
        stage_at_step: The stage whose formula describes the state held after
            ``optimizer.step()``; differs from ``zero_stage`` for FSDP1's ``SHARD_GRAD_OP``
            (ZeRO-2 in forward/backward, but it reshards after backward).
        full_grads: Whether every rank keeps a full-size gradient buffer (ShardedDDP with
            its reduce buckets), see :func:`~fsdp_guide.memory.estimate_model_state`.
        hybrid: Whether the state is sharded within groups of two ranks and replicated
            across groups (FSDP1 ``HYBRID_SHARD``).
        needs_cuda: Whether it only runs on GPUs (FairScale FSDP).
    """

    name: str
    summary: str
    zero_stage: int
    stage_at_step: int
    full_grads: bool = False
    hybrid: bool = False
    needs_cuda: bool = False

    def shard_group_size(self, world_size: int) -> int:
        """Ranks the state is sharded over.

        Examples:
            >>> STRATEGIES["fsdp_hybrid"].shard_group_size(4)
            2
            >>> STRATEGIES["fsdp"].shard_group_size(4)
            4
        """
        if self.hybrid and world_size % 2 == 0:
            return 2
        return world_size

    def predict(self, num_params: int, world_size: int) -> ModelState:
        """The fp32 Adam ZeRO prediction for the state held at the measuring point.

        Examples:
            >>> STRATEGIES["oss"].predict(1000, 2)
            ModelState(params=4000, grads=4000, optimizer=4000, total=12000)
        """
        return estimate_model_state(
            num_params,
            self.shard_group_size(world_size),
            self.stage_at_step,
            "fp32",
            "adam",
            full_grads=self.full_grads,
        )


STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec("ddp", "PyTorch DDP, gradients as bucket views", 0, 0),
        StrategySpec("zero1", "DDP + torch ZeroRedundancyOptimizer", 1, 1),
        StrategySpec("oss", "DDP + FairScale OSS (sharded optimizer)", 1, 1),
        StrategySpec("sharded_ddp", "FairScale OSS + ShardedDDP, reduce_buffer_size=0", 2, 2),
        StrategySpec(
            "sharded_ddp_buckets",
            "FairScale OSS + ShardedDDP, default reduce buckets",
            2,
            2,
            full_grads=True,
        ),
        StrategySpec("fsdp", "PyTorch FSDP1, FULL_SHARD", 3, 3),
        StrategySpec("fsdp_grad_op", "PyTorch FSDP1, SHARD_GRAD_OP", 2, 3),
        StrategySpec("fsdp_no_shard", "PyTorch FSDP1, NO_SHARD", 0, 0),
        StrategySpec("fsdp_hybrid", "PyTorch FSDP1, HYBRID_SHARD in pairs", 3, 3, hybrid=True),
        StrategySpec("fsdp2", "PyTorch FSDP2, fully_shard per block", 3, 3),
        StrategySpec("fairscale_fsdp", "FairScale FSDP (CUDA)", 3, 3, needs_cuda=True),
    )
}

#: What ``compare`` runs without ``--strategies`` (plus ``fairscale_fsdp`` with CUDA).
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "oss", "sharded_ddp", "fsdp", "fsdp2")


def check_strategies(names: list[str] | tuple[str, ...]) -> list[StrategySpec]:
    """Look up strategy names, refusing unknown ones and CUDA-only ones without CUDA.

    Raises:
        ValueError: For an empty list, an unknown or repeated name, or a CUDA-only strategy
            on CPU.

    Examples:
        >>> [s.zero_stage for s in check_strategies(["ddp", "fsdp"])]
        [0, 3]
        >>> check_strategies(["zero4"])
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero4'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    if not names:
        raise ValueError("no strategy given; name at least one, e.g. ddp,fsdp")
    specs = []
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        if names.count(name) > 1:
            raise ValueError(f"strategy {name!r} is given twice; name each strategy once")
        spec = STRATEGIES[name]
        if spec.needs_cuda and not torch.cuda.is_available():
            raise ValueError(f"strategy {name!r} needs CUDA, and no GPU is visible; leave it out")
        specs.append(spec)
    return specs


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _adam(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    # Bucket views: the gradients live in DDP's buckets, so there is one copy to count.
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def _largest_first(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sorted largest first, for OSS.

    OSS gives each tensor, in the order it receives them, to the rank with the fewest
    elements so far. In model order that leaves the demo transformer's shards up to 7% apart
    at 4 ranks; largest first (what ZeroRedundancyOptimizer does itself) evens them out.
    """
    return sorted(model.parameters(), key=lambda p: p.numel(), reverse=True)


def _sharded_ddp(model: nn.Module, lr: float, buffer: int) -> Wrapped:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    optimizer = OSS(_largest_first(model), optim=torch.optim.Adam, lr=lr)
    return ShardedDataParallel(model, optimizer, reduce_buffer_size=buffer), optimizer


def _fsdp1(model: nn.Module, device: torch.device, strategy: str, world_size: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    kwargs: dict[str, Any] = {}
    if strategy.startswith("HYBRID") or strategy.startswith("_HYBRID"):
        from torch.distributed.device_mesh import init_device_mesh

        shard = 2 if world_size % 2 == 0 else world_size
        # A 2-D mesh (replicate, shard): no GPU-count guessing, so it runs on gloo too.
        kwargs["device_mesh"] = init_device_mesh(
            device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    return FullyShardedDataParallel(
        model, device_id=device, sharding_strategy=ShardingStrategy[strategy], **kwargs
    )


def _fsdp2(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for layer in getattr(model, "blocks", []):  # one shard group per transformer block
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fairscale_fsdp(model: nn.Module) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel

    wrapped: nn.Module = FullyShardedDataParallel(model, mixed_precision=False)
    return wrapped


def wrap_for_strategy(
    model: nn.Module, strategy: str, world_size: int, lr: float = 1e-3
) -> Wrapped:
    """Wrap ``model`` for ``strategy`` and build its Adam optimizer, inside a launched rank.

    The process group must be up (:func:`fsdp_guide.launch` does that). On NCCL the model
    moves to this rank's GPU; on gloo it stays on CPU.

    Args:
        model: The model, identical on every rank.
        strategy: A name from :data:`STRATEGIES`.
        world_size: Number of ranks.
        lr: Adam's learning rate.

    Returns:
        The module to train and its optimizer.

    Raises:
        ValueError: For an unknown strategy, or a CUDA-only one without CUDA.

    Examples:
        >>> wrap_for_strategy(nn.Linear(2, 2), "zero3", 1)
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero3'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    (spec,) = check_strategies([strategy])
    device = torch.device("cuda", torch.cuda.current_device()) if spec.needs_cuda else _device()
    model = model.to(device)
    setups: dict[str, Callable[[], Wrapped]] = {
        "ddp": lambda: _with_adam(_ddp(model, device), lr),
        "zero1": lambda: _zero1(_ddp(model, device), lr),
        "oss": lambda: _oss(model, device, lr),
        "sharded_ddp": lambda: _sharded_ddp(model, lr, buffer=0),
        "sharded_ddp_buckets": lambda: _sharded_ddp(model, lr, buffer=2**23),
        "fsdp": lambda: _with_adam(_fsdp1(model, device, "FULL_SHARD", world_size), lr),
        "fsdp_grad_op": lambda: _with_adam(_fsdp1(model, device, "SHARD_GRAD_OP", world_size), lr),
        "fsdp_no_shard": lambda: _with_adam(_fsdp1(model, device, "NO_SHARD", world_size), lr),
        "fsdp_hybrid": lambda: _with_adam(_fsdp1(model, device, "HYBRID_SHARD", world_size), lr),
        "fsdp2": lambda: _with_adam(_fsdp2(model, device, world_size), lr),
        "fairscale_fsdp": lambda: _with_adam(_fairscale_fsdp(model), lr),
    }
    return setups[spec.name]()


def _with_adam(module: nn.Module, lr: float) -> Wrapped:
    return module, _adam(module.parameters(), lr)


def _zero1(module: nn.Module, lr: float) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer = ZeroRedundancyOptimizer(
        module.parameters(), optimizer_class=torch.optim.Adam, lr=lr
    )
    return module, optimizer


def _oss(model: nn.Module, device: torch.device, lr: float) -> Wrapped:
    from fairscale.optim import OSS

    # OSS first: it turns each rank's parameters into views of one flat buffer.
    optimizer = OSS(_largest_first(model), optim=torch.optim.Adam, lr=lr)
    return _ddp(model, device), optimizer
