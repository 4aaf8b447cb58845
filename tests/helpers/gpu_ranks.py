"""Rank functions of the CUDA tests, importable by spawned ranks (the test process stays off CUDA).

- :func:`fairscale_rank`: FairScale FSDP through ``shard(engine="fairscale")`` beside the
  unsharded model on the same GPU, its model state after a step, and checkpoint round trips
  in both formats (``tests/gpu/test_fairscale_checkpoint_gpu.py``).
- :func:`peak_memory_rank`: the CUDA peak of a training step of a 303,360,000-parameter
  TinyTransformer, plain, with each Block checkpointed, or under FairScale FSDP
  (``tests/gpu/test_peak_memory_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide import checkpoint
from fsdp_guide.launcher import rank_device
from fsdp_guide.memory import measure_model_state, peak_memory
from fsdp_guide.models import (
    Block,
    TinyTransformer,
    TransformerConfig,
    build_model,
    count_params,
    loss_fn,
    shard_batch,
    synthetic_batch,
)
from fsdp_guide.wrap import (
    LayerPolicy,
    check_optimizer,
    checkpoint_layers,
    saved_activation_bytes,
    shard,
    sharded_units,
)

STEPS, BATCH = 5, 8  # the lessons' TinyTransformer, on batches of 8
# 24 blocks of width 1024 = 303,360,000 parameters (4.85 GB of fp32 Adam state), 8 x 512 tokens.
BIG = TransformerConfig(vocab_size=256, dim=1024, n_heads=16, n_layers=24, seq_len=512)


def _fairscale_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    plain = build_model("transformer", seed=seed).to(rank_device())
    model = shard(plain, "fairscale", LayerPolicy(Block))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    check_optimizer(model, optimizer)
    return model, optimizer


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """Train on this rank's slice of the seeded global batches; the mean loss over ranks."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in steps:
        tokens, targets = shard_batch(synthetic_batch("transformer", BATCH, step=step), rank, world)
        loss = loss_fn(model, (tokens.to(rank_device()), targets.to(rank_device())))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if after_step is not None and step == steps[-1]:
            after_step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, copied to the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def fairscale_rank(rank: int, world_size: int, work_dir: str) -> dict[str, Any]:
    """Train FairScale FSDP next to the plain model; save, load and resume in both formats."""
    del rank, world_size
    out: dict[str, Any] = {"device": str(rank_device()), "backend": str(dist.get_backend())}
    plain = build_model("transformer", seed=0).to(rank_device())
    out["reference"] = _train(plain, torch.optim.Adam(plain.parameters(), lr=1e-3), range(STEPS))
    out["num_params"] = count_params(plain)
    del plain
    model, optimizer = _fairscale_model(seed=0)
    out["units"] = {name: numel for name, (_, numel) in sharded_units(model).items()}
    state: dict[str, int] = {}
    measure = lambda: state.update(measure_model_state(model, optimizer).as_dict())  # noqa: E731
    out["losses"] = _train(model, optimizer, range(STEPS), measure)
    out["state"] = state
    for kind in ("full", "sharded"):
        path = Path(work_dir) / ("full.pt" if kind == "full" else "sharded")
        model, optimizer = _fairscale_model(seed=0)
        _train(model, optimizer, range(2))
        checkpoint.save(path, model, optimizer, kind=kind, extra={"step": 2})
        saved = cpu_state(model)
        uninterrupted = _train(model, optimizer, range(2, 5))
        fresh, fresh_optimizer = _fairscale_model(seed=1)  # other weights, no Adam state
        extra = checkpoint.load(path, fresh, fresh_optimizer)
        start = int(extra["step"]) if extra else -1
        out[kind] = {
            "path": str(path),
            "loaded": cpu_state(fresh),
            "saved": saved,
            "extra_step": start,
            "uninterrupted": uninterrupted,
            "resumed": _train(fresh, fresh_optimizer, range(start, start + 3)),
        }
    return out


def peak_memory_rank(rank: int, world_size: int, variant: str) -> dict[str, int]:
    """Bytes of one training step of :data:`BIG` once Adam's state exists, for ``variant``.

    ``variant`` is ``"plain"``, ``"checkpointed"`` (each Block) or ``"fairscale"`` (FairScale
    FSDP, a unit per Block). A warm-up step creates gradients and Adam's state, zeroed in place,
    so the whole model state exists during the measured forward and backward.
    """
    del rank, world_size
    device = rank_device()
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = TinyTransformer(BIG)
    if variant == "checkpointed":
        checkpoint_layers(model, Block)
    if variant == "fairscale":
        model = shard(model, engine="fairscale", policy=LayerPolicy(Block))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens, targets = synthetic_batch("transformer", BATCH, config=BIG)
    batch = (tokens.to(device), targets.to(device))
    loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    state = measure_model_state(model, optimizer)
    optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    activations, loss = saved_activation_bytes(model, lambda: loss_fn(model, batch))
    loss.backward()  # type: ignore[no-untyped-call]
    del loss
    torch.cuda.synchronize(device)
    peak = peak_memory(device)
    assert peak.kind == "cuda_peak_allocated", peak
    return {"state": state.total, "activations": activations, "peak": peak.bytes}
