"""Builders, training steps and exact comparisons shared by the checkpoint tests.

Functions here run inside ranks started by ``fsdp_guide.launch``: forked on CPU, spawned for
CUDA (a spawned rank imports the function it runs, so it must live in a module like this one).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide import checkpoint
from fsdp_guide.models import TinyTransformer, TransformerConfig, loss_fn, shard_batch
from fsdp_guide.models import synthetic_batch as make_batch

CONFIG = TransformerConfig(vocab_size=32, dim=16, n_heads=2, n_layers=2, seq_len=8, mlp_ratio=2)
GLOBAL_BATCH = 4
LR = 1e-2
REPLICATED = ("module", "ddp", "zero1", "oss", "sharded_ddp")
STEPS_BEFORE = 2
STEPS_AFTER = 3


def _syncing_types() -> tuple[type, ...]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    types: list[type] = [nn.parallel.DistributedDataParallel, FullyShardedDataParallel, FSDPModule]
    try:
        from fairscale.nn.data_parallel import FullyShardedDataParallel as FairScaleFSDP
        from fairscale.nn.data_parallel import ShardedDataParallel

        types += [ShardedDataParallel, FairScaleFSDP]
    except ImportError:
        pass
    return tuple(types)


_SYNCING = _syncing_types()


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build(
    strategy: str, seed: int = 0, config: TransformerConfig = CONFIG
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny transformer wrapped and optimised the way ``strategy`` does it."""
    torch.manual_seed(seed)
    model: nn.Module = TinyTransformer(config)
    params = list(model.parameters())
    if strategy == "module":
        return model, torch.optim.AdamW(params, lr=LR)
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(params, lr=LR)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
        return nn.parallel.DistributedDataParallel(model), optimizer
    if strategy in ("oss", "sharded_ddp"):
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        oss = OSS(params, optim=torch.optim.AdamW, lr=LR)
        if strategy == "oss":
            return nn.parallel.DistributedDataParallel(model), oss
        return ShardedDataParallel(model, oss), oss
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from fsdp_guide.models import Block

        wrapped = FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block})
        )
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR)
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world()[1],))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    if strategy == "fairscale_fsdp":
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model.cuda())
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR)
    raise ValueError(strategy)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    start: int,
    steps: int,
    global_batch: int = GLOBAL_BATCH,
) -> list[float]:
    """``steps`` optimiser steps on this rank's slice of the global batches; local losses.

    A plain module (no gradient sync) trains on the whole batch on every rank, so all
    ranks stay identical: rank 0's copy, the one saved, then stands for every rank.
    """
    rank, size = world()
    if not isinstance(model, _SYNCING):
        rank, size = 0, 1
    device = next(model.parameters()).device
    losses = []
    for step in range(start, start + steps):
        batch = shard_batch(
            make_batch("transformer", global_batch, step, config=CONFIG), rank, size
        )
        # model.zero_grad: ShardedDDP reduces through buckets that only its own zero_grad
        # clears; optimizer.zero_grad(set_to_none=True) would leave stale sums in them.
        model.zero_grad()
        loss = loss_fn(model, (batch[0].to(device), batch[1].to(device)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> Any:
    """The full model and optimizer state, taken with the libraries' own APIs (not ours)."""
    if strategy in ("module", "ddp", "fsdp1", "fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True)
        model_state, optim_state = get_state_dict(model, [optimizer], options=options)
        return clone({"model": dict(model_state), "optimizer": dict(optim_state)})
    if strategy == "fairscale_fsdp":
        state = {"model": dict(model.state_dict())}
        if model.world_size == 1:
            # Its gather needs buffers FairScale allocates only when it shards (2+ ranks);
            # on one rank the optimizer's own (flat) state is already the whole state.
            return clone({**state, "optimizer": optimizer.state_dict()})
        # FairScale's gather turns the `step` tensors of the dict it is given into floats in
        # place, and optimizer.state_dict() shares its per-parameter dicts with the live
        # optimizer, whose next step() would then fail: hand it copies of those dicts.
        sd = optimizer.state_dict()
        copies = SimpleNamespace(
            state_dict=lambda: {**sd, "state": {k: dict(v) for k, v in sd["state"].items()}}
        )
        state["optimizer"] = model.gather_full_optim_state_dict(copies)  # type: ignore[operator]
        return clone(state)
    inner = model.module if hasattr(model, "module") else model
    if strategy == "zero1":
        optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    elif strategy in ("oss", "sharded_ddp"):
        optimizer.consolidate_state_dict(recipient_rank=0)  # type: ignore[attr-defined]
    optim_state = optimizer.state_dict() if world()[0] == 0 else None
    return clone({"model": dict(inner.state_dict()), "optimizer": optim_state})


def clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(clone(v) for v in value)
    return value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where ``a`` and ``b`` are not bit-equal (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if path.endswith("/params"):  # a group's members: their order carries no meaning
            a, b = sorted(a, key=str), sorted(b, key=str)
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}/{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def count_tensors(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(count_tensors(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(count_tensors(v) for v in value)
    return 0


def save_load_resume(rank: int, world_size: int, strategy: str, kind: str, path: str) -> Any:
    """Train, save, go on 3 steps; then load into a fresh model and redo the 3 steps."""
    torch.manual_seed(100 + rank)  # extra's RNG state must come back exactly
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, start=0, steps=STEPS_BEFORE)
    extra = {"step": STEPS_BEFORE, "rng": torch.get_rng_state()}
    checkpoint.save(path, model, optimizer, kind=kind, extra=extra)  # type: ignore[arg-type]
    saved = snapshot(model, optimizer, strategy)
    uninterrupted = train(model, optimizer, start=STEPS_BEFORE, steps=STEPS_AFTER)

    fresh_model, fresh_optimizer = build(strategy, seed=1)  # other weights, no optimizer state
    before_load = snapshot(fresh_model, fresh_optimizer, strategy)
    restored_extra = checkpoint.load(path, fresh_model, fresh_optimizer)
    loaded = snapshot(fresh_model, fresh_optimizer, strategy)
    resumed = train(fresh_model, fresh_optimizer, start=restored_extra["step"], steps=STEPS_AFTER)
    return {
        "differences": differences(saved, loaded),
        "fresh_differed": bool(differences(saved["model"], before_load["model"])),
        "tensors": count_tensors(saved),
        "optimizer_tensors": count_tensors(saved["optimizer"]),
        "extra_ok": restored_extra["step"] == STEPS_BEFORE
        and torch.equal(restored_extra["rng"], extra["rng"]),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
    }
