"""CUDA peak memory of a training step against :func:`fsdp_guide.memory.plan`, one GPU.

A 303,360,000-parameter TinyTransformer (24 blocks of width 1024), 8 sequences of 512 tokens,
fp32 Adam, on one NCCL rank: DDP (the unsharded model), FairScale FSDP and FSDP2 (a unit per
``Block``), each without and with every ``Block`` checkpointed. Each setting runs in its own
spawned rank, so every peak starts from a fresh CUDA allocator.

In each rank a first step creates Adam's state; then ``torch.cuda.reset_peak_memory_stats``
and one whole steady step (forward, backward, ``optimizer.step()``, ``zero_grad()``). The
measured peak is ``torch.cuda.max_memory_allocated`` over that step. It is set against two of
the plan's figures: ``Plan.total`` (model state + saved activations + the largest transient
buffer, the sum a "will it fit" check uses) and ``Plan.step_peak`` (what the engine holds at
the step's fullest moment). Writes ``benchmarks/results/gpu_peak_vs_plan.md``.

Usage (needs a CUDA GPU; ``--small`` runs a tiny model on CPU under gloo to check the script,
its peak then read by torch's profiler through :func:`fsdp_guide.timeline.record_step`)::

    python benchmarks/gpu_peak_vs_plan.py
    python benchmarks/gpu_peak_vs_plan.py --small --out /tmp/peak.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_guide.launcher import launch, rank_device
from fsdp_guide.memory import measure_model_state, plan
from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, loss_fn, synthetic_batch
from fsdp_guide.timeline import record_step
from fsdp_guide.wrap import LayerPolicy, checkpoint_layers, shard

BIG = TransformerConfig(vocab_size=256, dim=1024, n_heads=16, n_layers=24, seq_len=512)
SMALL = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)
BATCH = 8
# (catalog strategy, shard() engine or None for DDP, checkpointing)
SETTINGS: list[tuple[str, str | None, Literal["blocks"] | None]] = [
    (strategy, engine, ac)
    for strategy, engine in (("ddp", None), ("fairscale_fsdp", "fairscale"), ("fsdp2", "fsdp2"))
    for ac in (None, "blocks")
]


def _model(config: TransformerConfig, engine: str | None, ac: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(rank_device()):
        model: torch.nn.Module = TinyTransformer(config)
    if ac is not None:
        checkpoint_layers(model, Block)
    if engine is None:
        device_ids = [rank_device()] if rank_device().type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return shard(model, engine=engine, policy=LayerPolicy(Block))


def peak_rank(
    rank: int, world_size: int, config: TransformerConfig, engine: str | None, ac: str | None
) -> dict[str, Any]:
    """One setting's model state and the peak of its second (steady) step, in bytes."""
    del rank, world_size
    device = rank_device()
    model = _model(config, engine, ac)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens, targets = synthetic_batch("transformer", BATCH, config=config)
    batch = (tokens.to(device), targets.to(device))
    loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    state = measure_model_state(model, optimizer)
    optimizer.zero_grad()
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
        # what the caching allocator held at most: the figure that runs out first
        reserved = int(torch.cuda.max_memory_reserved(device))
    else:  # the profiler's view of the same step, the state held before it included

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        peak = record_step(
            lambda: loss_fn(model, batch),
            lambda loss: loss.backward(),
            step,
            state_before={"params": state.params, "optimizer": state.optimizer},
        ).peak
        reserved = peak  # no caching allocator on the CPU
    return {
        "state": state.total,
        "peak": peak,
        "reserved": reserved,
        "seconds": time.perf_counter() - start,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": str(dist.get_backend()),
    }


def measured_rows(report: Path) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    """The device line and each setting's measured figures from an earlier report, in bytes
    (MB as printed, so to 0.1 MB)."""
    text = report.read_text()
    where = text.split("Device: ", 1)[1].split(";", 1)[0]
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 14 and cells[0] in {s for s, _, _ in SETTINGS}:
            number = [float(c.replace(",", "")) for c in cells[2:]]
            rows[(cells[0], cells[1])] = {
                "state": number[0] * 1e6,
                "peak": number[6] * 1e6,
                "reserved": number[9] * 1e6,
                "seconds": number[11],
            }
    return where, rows


def run(small: bool, replan: Path | None = None) -> list[str]:
    """Measure and plan every setting (or plan again the settings an earlier report
    measured); the report's lines."""
    config = SMALL if small else BIG
    backend: Literal["gloo", "nccl"] = "gloo" if small else "nccl"
    rows, where = [], ""
    earlier = measured_rows(replan) if replan is not None else None
    spare: list[float] = []  # the share of the reserved peak not allocated at the peak
    for strategy, engine, ac in SETTINGS:
        if small and engine == "fairscale":  # FairScale FSDP runs on CUDA only
            continue
        if earlier is not None:
            where, m = earlier[0], earlier[1][(strategy, ac or "none")]
        else:
            (m,) = launch(
                peak_rank,
                1,
                args=(config, engine, ac),
                backend=backend,
                start_method="spawn",
                timeout=300,
            )
            where = f"{m['device']} ({m['backend']})"
        p = plan(
            lambda: TinyTransformer(config),
            batch_size=BATCH,
            seq_len=config.seq_len,
            world_size=1,
            strategy=strategy,
            activation_checkpointing=ac,
            # the DDP built above keeps torch's default: a bucket copy of every gradient
            settings={"gradient_as_bucket_view": False} if engine is None else None,
        )
        rows.append(
            f"| {strategy} | {ac or 'none'} | {m['state'] / 1e6:,.1f} | {p.state.total / 1e6:,.1f}"
            f" | {p.activations / 1e6:,.1f} | {p.transient / 1e6:,.1f} | {p.total / 1e6:,.1f}"
            f" | {p.step_peak / 1e6:,.1f} | {m['peak'] / 1e6:,.1f} | {m['peak'] / p.total:.3f}"
            f" | {m['peak'] / p.step_peak:.3f} | {m['reserved'] / 1e6:,.1f}"
            f" | {m['reserved'] / p.step_peak:.3f} | {m['seconds']:.2f} |"
        )
        spare.append((m["reserved"] - m["peak"]) / m["reserved"])
        print(rows[-1], flush=True)
    versions = f"torch {torch.__version__}" + (
        f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    )
    return [
        "# CUDA peak of a training step against the plan",
        "",
        f"Device: {where}; {versions}; {platform.machine()}.",
        f"Model: TinyTransformer {config}, batch {BATCH} x {config.seq_len} tokens, fp32 Adam, "
        "one rank. Bytes in MB (10^6).",
        "",
        "Measured: the model state after `optimizer.step()` (`measure_model_state`) and the "
        "peak of one steady step (`torch.cuda.max_memory_allocated` after "
        "`reset_peak_memory_stats`; forward, backward, `step()`, `zero_grad()`). Planned: "
        "`plan(...)` for the same model, batch and checkpointing. Ratios are measured peak / "
        "planned figure: `Plan.total` (state + activations + transient) and `Plan.step_peak`.",
        "",
        "| strategy | checkpointing | state measured | state planned | activations"
        " | transient | Plan.total | Plan.step_peak | peak measured | peak / total"
        " | peak / step_peak | reserved | reserved / step_peak | step s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
        *rows,
        "",
        "`reserved` is `torch.cuda.max_memory_reserved`: what the caching allocator held at "
        "most, the figure that runs out first. The part of it not allocated at the peak is "
        f"fragmentation and cached free blocks: {min(spare, default=0):.1%} to "
        f"{max(spare, default=0):.1%} of the reserved peak in these settings.",
        "",
        f"Generated by `python benchmarks/gpu_peak_vs_plan.py{' --small' if small else ''}"
        + (f" --replan {replan.name}" if replan is not None else "")
        + "`"
        + (" (measured figures from that report, planned again)." if replan else "."),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run every setting; write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--small", action="store_true", help="tiny model on CPU (gloo)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "gpu_peak_vs_plan.md"
    )
    parser.add_argument(
        "--replan",
        type=Path,
        default=None,
        help="plan again the settings an earlier report measured (no GPU needed)",
    )
    args = parser.parse_args(argv)
    if not args.small and args.replan is None and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --small for the CPU check", file=sys.stderr)
        return 2
    lines = run(args.small, args.replan)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
