"""Step ``fairscale``: ``shard(engine="fairscale")`` at world size 1 on NCCL, and its checkpoints.

``fsdp_guide.launch`` starts one spawned rank with NCCL (:func:`fairscale_worker`), as the
lessons' cells do on a workstation. The parent then consolidates the sharded checkpoint and
loads both files into a plain model on the CPU, with no process group.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._checks import Checks

if TYPE_CHECKING:
    import torch
    from torch import nn

# The lessons' default TinyTransformer, trained on batches of 8.
STEPS = 5
BATCH = 8


def _fairscale_model(device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The lessons' TinyTransformer sharded by FairScale, a unit per Block, and its Adam."""
    import torch

    from fsdp_guide.models import Block, build_model
    from fsdp_guide.wrap import LayerPolicy, check_optimizer, shard

    model = shard(build_model("transformer", seed=seed).to(device), "fairscale", LayerPolicy(Block))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    check_optimizer(model, optimizer)
    return model, optimizer


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    steps: range,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """Train on this rank's slice of the seeded global batches; mean loss over ranks."""
    import torch.distributed as dist

    from fsdp_guide.launcher import rank_device
    from fsdp_guide.models import loss_fn, shard_batch, synthetic_batch

    device = rank_device()
    losses = []
    for step in steps:
        batch = shard_batch(synthetic_batch("transformer", BATCH, step=step), rank, world_size)
        loss = loss_fn(model, (batch[0].to(device), batch[1].to(device)))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if after_step is not None and step == steps[-1]:
            after_step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if dist.is_initialized() and world_size > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def _cpu_state(model: nn.Module) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _bit_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fairscale_worker(rank: int, world_size: int, work_dir: str) -> dict[str, Any]:
    """One rank of :func:`fairscale_checks` (run by ``fsdp_guide.launch`` with NCCL).

    Trains the sharded model against an unsharded reference on the same GPU, measures the
    model state after a step, and saves, loads and resumes through ``fsdp_guide.checkpoint``
    in both formats.

    Returns:
        Plain values for the parent: losses, states, the units, and the round trips.
    """
    import torch

    from fsdp_guide import checkpoint
    from fsdp_guide.launcher import rank_device
    from fsdp_guide.memory import measure_model_state
    from fsdp_guide.models import build_model, count_params
    from fsdp_guide.wrap import sharded_units

    device = rank_device()
    out: dict[str, Any] = {"device": str(device), "backend": str(torch.distributed.get_backend())}
    plain = build_model("transformer", seed=0).to(device)
    # The whole global batch, as one process would (rank 0 of 1).
    out["reference"] = _train(
        plain, torch.optim.Adam(plain.parameters(), lr=1e-3), 0, 1, range(STEPS)
    )
    out["num_params"] = count_params(plain)
    del plain

    model, optimizer = _fairscale_model(device, seed=0)
    out["units"] = {name: numel for name, (_, numel) in sharded_units(model).items()}
    state: dict[str, Any] = {}

    def measure() -> None:
        state.update(measure_model_state(model, optimizer).as_dict())

    out["losses"] = _train(model, optimizer, rank, world_size, range(STEPS), measure)
    out["state"] = state
    out["param_devices"] = sorted({p.device.type for p in model.parameters()})

    for kind in ("full", "sharded"):
        path = Path(work_dir) / ("fairscale_full.pt" if kind == "full" else "fairscale_sharded")
        model, optimizer = _fairscale_model(device, seed=0)
        _train(model, optimizer, rank, world_size, range(2))
        checkpoint.save(path, model, optimizer, kind=kind, extra={"step": 2})
        saved = _cpu_state(model)
        uninterrupted = _train(model, optimizer, rank, world_size, range(2, 5))
        fresh, fresh_opt = _fairscale_model(device, seed=1)  # other weights, no Adam state
        extra = checkpoint.load(path, fresh, fresh_opt)
        equal = _bit_equal(saved, _cpu_state(fresh))
        start = int(extra["step"]) if extra else -1
        resumed = _train(fresh, fresh_opt, rank, world_size, range(start, start + 3))
        out[kind] = {
            "path": str(path),
            "bit_equal_after_load": equal,
            "extra_step": start,
            "uninterrupted": uninterrupted,
            "resumed": resumed,
        }
        if rank == 0:  # for the parent to compare with what it loads offline
            out[kind]["saved"] = saved
    return out


def fairscale_checks(work_dir: Path) -> int:
    """Check what one rank of :func:`fairscale_worker` returns, then load its files offline.

    Args:
        work_dir: Where the checkpoints are written.

    Returns:
        The exit status: 1 when a check failed.
    """
    from fsdp_guide import checkpoint, launch
    from fsdp_guide.memory import estimate_model_state
    from fsdp_guide.models import build_model

    checks = Checks("fairscale")
    work = work_dir / "fairscale"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    results: list[dict[str, Any]] = []

    def run() -> None:
        results.extend(
            launch(
                fairscale_worker,
                1,
                args=(str(work),),
                backend="nccl",
                start_method="spawn",
                timeout=240,
            )
        )

    checks.guard("launch", run)
    if not results:
        return checks.finish()
    r = results[0]
    checks.record(
        "rank device",
        r["device"].startswith("cuda") and "nccl" in r["backend"],
        f"{r['device']}, {r['backend']}",
    )
    diff = checks.close("losses = unsharded model's", r["losses"], r["reference"], 1e-4)
    n, units = int(r["num_params"]), r["units"]
    checks.record(
        "a unit per Block plus the root", len(units) == 5 and sum(units.values()) == n, f"{units}"
    )
    state = r["state"]
    predicted = estimate_model_state(n, 1, 3)
    # One rank: no padding; Adam's step counter is one 4-byte tensor per flat parameter.
    exact = (state["params"], state["grads"], state["optimizer"]) == (
        4 * n,
        4 * n,
        8 * n + 4 * len(units),
    )
    checks.record(
        "model state after a step", exact, f"measured {state}, ZeRO-3 formula {predicted.as_dict()}"
    )
    checks.table(
        "FairScale FSDP via fsdp_guide.launch, 1 rank, NCCL",
        {
            "parameters": n,
            "units": len(units),
            "params (B)": state["params"],
            "grads (B)": state["grads"],
            "optimizer (B)": state["optimizer"],
            "ZeRO-3 formula total (B)": predicted.total,
            "largest loss difference": f"{diff:.1e}",
        },
    )
    for kind in ("full", "sharded"):
        ck = r[kind]
        checks.record(
            f"{kind} checkpoint: weights bit-equal after load",
            bool(ck["bit_equal_after_load"]),
            ck["path"],
        )
        checks.record(
            f"{kind} checkpoint: extra restored", ck["extra_step"] == 2, f"step {ck['extra_step']}"
        )
        checks.close(
            f"{kind} checkpoint: resumed = uninterrupted", ck["resumed"], ck["uninterrupted"], 1e-5
        )

    def offline() -> None:
        target = work / "consolidated.pt"
        summary = checkpoint.consolidate(r["sharded"]["path"], target)
        checks.record("consolidate", summary.get("strategy") == "fairscale_fsdp", str(summary))
        for name, path, kind in (
            ("full file", Path(r["full"]["path"]), "full"),
            ("consolidated shards", target, "sharded"),
        ):
            plain = build_model("transformer", seed=1)
            checkpoint.load(path, plain, None)  # one process, no process group
            checks.record(
                f"{name} loads into a plain CPU model, bit-equal",
                _bit_equal(r[kind]["saved"], plain.state_dict()),
                str(path),
            )

    checks.guard("offline load", offline)
    return checks.finish()
