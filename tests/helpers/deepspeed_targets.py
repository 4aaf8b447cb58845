"""Functions the DeepSpeed tests run in launched ranks (importable, so spawn works too)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide.deepspeed import backward_and_step
from fsdp_guide.engines import engine_for, wrap_for_strategy
from fsdp_guide.models import build_model, loss_fn, shard_batch, synthetic_batch

BATCH = 8
MODEL = "transformer"


def global_loss(loss: torch.Tensor) -> float:
    """The loss of the whole batch: the mean of the ranks' losses on equal slices."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(
    module: nn.Module, optimizer: Any, rank: int, world_size: int, steps: range
) -> list[float]:
    """Steps ``steps`` (batch i is seeded by i) and the whole-batch loss of each."""
    losses = []
    for step in steps:
        batch = shard_batch(synthetic_batch(MODEL, BATCH, step), rank, world_size)
        loss = loss_fn(module, batch)
        backward_and_step(module, optimizer, loss)
        losses.append(global_loss(loss))
    return losses


def built(name: str, world_size: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return wrap_for_strategy(build_model(MODEL), name, world_size)


def losses_per_strategy(rank: int, world_size: int, names: list[str], steps: int) -> Any:
    """Whole-batch losses of ``steps`` steps under each strategy; and what PATH offered."""
    from fsdp_guide.deepspeed import find_compiler

    out: dict[str, Any] = {"compiler": find_compiler()}
    for name in names:
        module, optimizer = built(name, world_size)
        out[name] = train(module, optimizer, rank, world_size, range(steps))
    loaded = sorted(m for m in sys.modules if "shm_comm" in m)
    out["loaded_extensions"] = loaded
    return out


def rank_state(module: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """Every tensor of this rank's training state: parameters (ZeRO-3: this rank's shard),
    the fp32 master partitions and Adam's state, as copies."""
    tensors = [getattr(p, "ds_tensor", p) for p in module.parameters()]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += list(getattr(optimizer, name, []))
    inner = optimizer.optimizer
    for per_param in inner.state.values():
        tensors += [v for _, v in sorted(per_param.items()) if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in tensors]


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The engine's whole fp32 parameters by name (gathered under ZeRO-3)."""
    import deepspeed

    inner: nn.Module = module.module  # type: ignore[assignment]
    with deepspeed.zero.GatheredParameters(list(inner.parameters())):
        return {n: p.detach().clone() for n, p in inner.named_parameters()}


def checkpoint_round_trip(rank: int, world_size: int, name: str, root: str) -> dict[str, Any]:
    """Train 2 steps, save, train 2 more; then a fresh engine loads and trains the same 2."""
    from fsdp_guide import checkpoint

    path = Path(root) / "ckpt"
    module, optimizer = built(name, world_size)
    train(module, optimizer, rank, world_size, range(2))
    saved_state = rank_state(module, optimizer)
    weights = full_weights(module)
    checkpoint.save(path, module, optimizer, kind="sharded", extra={"step": 2})
    uninterrupted = train(module, optimizer, rank, world_size, range(2, 4))

    fresh, fresh_optimizer = built(name, world_size)
    extra = checkpoint.load(path, fresh, fresh_optimizer)
    loaded_state = rank_state(fresh, fresh_optimizer)
    resumed = train(fresh, fresh_optimizer, rank, world_size, range(2, 4))
    return {
        "extra": extra,
        "bit_equal": len(saved_state) == len(loaded_state)
        and all(torch.equal(a, b) for a, b in zip(saved_state, loaded_state, strict=True)),
        "tensors": len(saved_state),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "weights": weights if rank == 0 else None,
        "detected": engine_for(module, optimizer).name,
    }


def failed_save_keeps_the_previous(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A save whose write fails on rank 1 raises on every rank; the first checkpoint loads."""
    from fsdp_guide import checkpoint
    from fsdp_guide.errors import CheckpointError

    path = Path(root) / "ckpt"
    module, optimizer = built("deepspeed_zero2", world_size)
    train(module, optimizer, rank, world_size, range(1))
    first = rank_state(module, optimizer)
    checkpoint.save(path, module, optimizer, kind="sharded")
    train(module, optimizer, rank, world_size, range(1, 2))
    engine: Any = module
    if rank == 1:

        def broken(state_dict: Any, target: str) -> None:
            raise OSError(28, "No space left on device")

        engine.checkpoint_engine.save = broken
    error = ""
    try:
        checkpoint.save(path, module, optimizer, kind="sharded")
    except CheckpointError as exc:
        error = str(exc)
    fresh, fresh_optimizer = built("deepspeed_zero2", world_size)
    checkpoint.load(path, fresh, fresh_optimizer)
    loaded = rank_state(fresh, fresh_optimizer)
    return {
        "error": error,
        "first_kept": all(torch.equal(a, b) for a, b in zip(first, loaded, strict=True)),
        "data_dirs": sorted(p.name for p in path.iterdir() if p.name.startswith("data-")),
    }
