"""Step ``memory``: CUDA peak memory of a 303,360,000-parameter TinyTransformer, predicted.

``TransformerConfig(vocab_size=256, dim=1024, n_heads=16, n_layers=24, seq_len=512)``, 8
sequences of 512 tokens, fp32 Adam. For each variant (one GPU with no sharding; the same
with each Block checkpointed; FairScale FSDP at world size 1 on NCCL, a unit per Block) the
peak of a training step's forward and backward (``fsdp_guide.memory.peak_memory``) is
compared with the predicted model state (``estimate_model_state``) plus the measured saved
activations (``saved_activation_bytes``); ``plan()``'s traced activations and total are
shown beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._checks import Checks

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdp_guide.models import TransformerConfig

# 24 blocks of width 1024 = 303,360,000 parameters (4.85 GB of fp32 Adam state).
MODEL = {"vocab_size": 256, "dim": 1024, "n_heads": 16, "n_layers": 24, "seq_len": 512}
BATCH = 8
# The peak may exceed the prediction by transient buffers (the loss's gradient, attention
# workspace, recomputed blocks, FSDP's gathered units); more than this is a failure.
SLACK = 1.5


def _config() -> TransformerConfig:
    from fsdp_guide.models import TransformerConfig

    return TransformerConfig(**MODEL)


def _measure_step_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, baseline: int = 0
) -> dict[str, int]:
    """CUDA memory of a training step once the optimizer state exists.

    A warm-up step creates the gradients and Adam's state; they are zeroed in place, so
    all of the model state exists during the measured forward and backward, as
    :func:`~fsdp_guide.memory.measure_model_state` counts it after a step. Returns bytes:
    the measured model state, the saved activations, allocated memory before the
    forward, the peak over forward and backward, and the peak of ``optimizer.step()``;
    memory readings less ``baseline``, what this process held before the model was built.
    """
    import torch

    from fsdp_guide.memory import measure_model_state, peak_memory
    from fsdp_guide.models import loss_fn, synthetic_batch
    from fsdp_guide.wrap import saved_activation_bytes

    tokens, targets = synthetic_batch("transformer", BATCH, config=_config())
    batch = (tokens.to(device), targets.to(device))
    loss = loss_fn(model, batch)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    state = measure_model_state(model, optimizer)
    optimizer.zero_grad(set_to_none=False)
    del loss
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    activations, loss = saved_activation_bytes(model, lambda: loss_fn(model, batch))
    loss.backward()  # type: ignore[no-untyped-call]
    del loss
    torch.cuda.synchronize(device)
    peak = peak_memory(device)
    assert peak.kind == "cuda_peak_allocated", peak
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    torch.cuda.synchronize(device)
    return {
        "params": state.params,
        "grads": state.grads,
        "optimizer": state.optimizer,
        "state": state.total,
        "activations": activations,
        "before_forward": before - baseline,
        "peak_forward_backward": peak.bytes - baseline,
        "peak_optimizer_step": peak_memory(device).bytes - baseline,
    }


def memory_worker(rank: int, world_size: int) -> dict[str, int]:
    """One rank of the FairScale FSDP variant of :func:`memory_checks` (NCCL)."""
    import torch

    from fsdp_guide.launcher import rank_device
    from fsdp_guide.models import Block, TinyTransformer
    from fsdp_guide.wrap import LayerPolicy, shard

    device = rank_device()
    torch.manual_seed(0)
    with torch.device(device):
        plain = TinyTransformer(_config())
    model = shard(plain, engine="fairscale", policy=LayerPolicy(Block))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return _measure_step_memory(model, optimizer, device)


def memory_checks(work_dir: Path) -> int:
    """Measure each variant and check it against the prediction.

    Args:
        work_dir: Unused (the step writes nothing).

    Returns:
        The exit status: 1 when a check failed.
    """
    import torch

    from fsdp_guide import launch
    from fsdp_guide.memory import estimate_model_state, plan
    from fsdp_guide.models import Block, TinyTransformer, count_params
    from fsdp_guide.wrap import checkpoint_layers

    del work_dir
    checks = Checks("memory")
    config = _config()
    with torch.device("meta"):
        n = count_params(TinyTransformer(config))
    checks.record("model size", n == 303_360_000, f"{n:,} parameters, {config}")
    title = (
        f"CUDA peak memory, {n:,} parameters, batch {BATCH} x {config.seq_len}"
        " tokens, fp32 Adam (GB)"
    )

    def compare(
        variant: str, stage: int, strategy: str, m: dict[str, int], checkpointing: Any
    ) -> None:
        predicted = estimate_model_state(n, 1, stage)
        planned = plan(
            lambda: TinyTransformer(config),
            batch_size=BATCH,
            seq_len=config.seq_len,
            world_size=1,
            strategy=strategy,
            activation_checkpointing=checkpointing,
        )
        expected = predicted.total + m["activations"]
        ratio = m["peak_forward_backward"] / expected
        state_diff = abs(m["state"] - predicted.total) / predicted.total
        checks.record(
            f"{variant}: model state = prediction",
            state_diff < 1e-3,
            f"measured {m['state']:,} B, predicted {predicted.total:,} B",
        )
        lower = m["state"] + m["activations"] <= m["peak_forward_backward"]
        checks.record(
            f"{variant}: state + activations <= peak <= {SLACK} x prediction",
            lower and ratio <= SLACK,
            f"peak {m['peak_forward_backward']:,} B = {ratio:.3f} x prediction"
            f" ({predicted.total:,} B state + {m['activations']:,} B activations)",
        )
        gb = 1e9
        checks.table(
            title,
            {
                "variant": variant,
                "predicted state": round(predicted.total / gb, 3),
                "measured state": round(m["state"] / gb, 3),
                "saved activations (measured)": round(m["activations"] / gb, 3),
                "saved activations (plan, traced)": round(planned.activations / gb, 3),
                "prediction (state + activations)": round(expected / gb, 3),
                "CUDA peak, forward+backward": round(m["peak_forward_backward"] / gb, 3),
                "peak / prediction": round(ratio, 3),
                "plan() total": round(planned.total / gb, 3),
                "CUDA peak, optimizer step": round(m["peak_optimizer_step"] / gb, 3),
            },
        )

    def fairscale() -> None:
        (m,) = launch(memory_worker, 1, backend="nccl", start_method="spawn", timeout=200)
        compare("FairScale FSDP, 1 rank, NCCL, unit per Block", 3, "fairscale_fsdp", m, None)

    def single(checkpointed: bool) -> None:
        device = torch.device("cuda", 0)
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)  # what an earlier variant left
        torch.manual_seed(0)
        with torch.device(device):
            model = TinyTransformer(config)
        if checkpointed:
            checkpoint_layers(model, Block)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        m = _measure_step_memory(model, optimizer, device, baseline)
        del model, optimizer
        torch.cuda.empty_cache()
        name = "one GPU, each Block checkpointed" if checkpointed else "one GPU, no sharding"
        compare(name, 0, "ddp", m, "blocks" if checkpointed else None)

    # FairScale first: its rank is spawned before this process holds any CUDA memory.
    checks.guard("fairscale_fsdp", fairscale)
    checks.guard("single", lambda: single(False))
    checks.guard("checkpointed", lambda: single(True))
    return checks.finish()
