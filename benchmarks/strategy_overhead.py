"""Steps per second of ``DDPShardedStrategy`` against a hand-written OSS + ShardedDDP loop.

Both train the same TinyTransformer (AdamW) on the same token data, on 2 gloo ranks forked
from this process, one thread per rank. Runs alternate (hand, Lightning, hand, ...) so that
load from other processes hits both alike; medians are compared. Timed steps
exclude a few warm-up steps. The per-step losses of the two are also compared: the strategy
must train the same model, not only as fast.

Usage:
    PYTHONPATH=$PWD python benchmarks/strategy_overhead.py [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_guide import launch
from fsdp_guide.models import TinyTransformer, TransformerConfig, count_params, loss_fn
from fsdp_guide.strategies import DDPShardedStrategy

CONFIG = TransformerConfig(vocab_size=512, dim=256, n_heads=4, n_layers=4, seq_len=64)
BATCH_PER_RANK = 8
WORLD_SIZE = 2
LR = 1e-3


def make_data(steps: int) -> tuple[Tensor, Tensor]:
    """Global data for ``steps`` steps, split between ranks by a DistributedSampler."""
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH_PER_RANK * WORLD_SIZE
    seq = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


def hand_written(rank: int, world_size: int, steps: int, warmup: int) -> dict[str, Any]:
    """The loop from the FairScale docs: OSS around AdamW, ShardedDDP around the model."""
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    tokens, targets = make_data(steps)
    # The order Lightning's DistributedSampler gives this rank in epoch 0 (it shuffles, seed 0).
    order = list(DistributedSampler(range(len(tokens)), world_size, rank, shuffle=True, seed=0))
    tokens, targets = tokens[order], targets[order]
    model = build()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR)
    model = ShardedDataParallel(model, optimizer)
    losses, start, cpu_start = [], 0.0, 0.0
    for step in range(steps):
        if step == warmup:
            start, cpu_start = time.perf_counter(), time.process_time()
        batch = slice(step * BATCH_PER_RANK, (step + 1) * BATCH_PER_RANK)
        optimizer.zero_grad(set_to_none=False)  # keep ShardedDDP's bucket views
        loss = loss_fn(model, (tokens[batch], targets[batch]))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "losses": losses,
    }


class TimedTransformer(pl.LightningModule):
    def __init__(self, steps: int, warmup: int, out: Path) -> None:
        super().__init__()
        self.model, self.steps, self.warmup, self.out = build(), steps, warmup, out
        self.losses: list[float] = []
        self.start = self.cpu_start = 0.0

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        loss = loss_fn(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_end(self) -> None:
        seconds = time.perf_counter() - self.start
        cpu_seconds = time.process_time() - self.cpu_start
        if self.global_rank == 0:
            record = {"seconds": seconds, "cpu_seconds": cpu_seconds, "losses": self.losses}
            self.out.write_text(json.dumps(record))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return DataLoader(TensorDataset(*make_data(self.steps)), batch_size=BATCH_PER_RANK)


def lightning(steps: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        trainer = pl.Trainer(
            strategy=DDPShardedStrategy(start_method="fork"),
            accelerator="cpu",
            devices=WORLD_SIZE,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(TimedTransformer(steps, warmup, out))
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def fmt(rates: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/strategy_overhead.md"))
    args = parser.parse_args()
    timed = args.steps - args.warmup

    hand_runs, pl_runs = [], []
    for _ in range(args.repeats):
        hand_runs.append(
            launch(
                hand_written,
                WORLD_SIZE,
                args=(args.steps, args.warmup),
                backend="gloo",
                start_method="fork",
                timeout=600,
            )[0]
        )
        pl_runs.append(lightning(args.steps, args.warmup))
    hand_rates = [timed / r["seconds"] for r in hand_runs]
    pl_rates = [timed / r["seconds"] for r in pl_runs]
    hand_cpu = [timed / r["cpu_seconds"] for r in hand_runs]
    pl_cpu = [timed / r["cpu_seconds"] for r in pl_runs]
    cpu_ratio = statistics.median(pl_cpu) / statistics.median(hand_cpu)
    ratio = max(pl_rates) / max(hand_rates)
    median_ratio = statistics.median(pl_rates) / statistics.median(hand_rates)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    loss_gap = max(
        abs(a - b) / abs(b)
        for a, b in zip(pl_runs[0]["losses"], hand_runs[0]["losses"], strict=True)
    )

    lines = [
        "# DDPShardedStrategy overhead vs a hand-written OSS + ShardedDDP loop",
        "",
        f"Model: TinyTransformer {CONFIG} ({count_params(build()):,} parameters), AdamW,",
        f"{WORLD_SIZE} gloo ranks on CPU (forked, 1 thread each), {BATCH_PER_RANK} sequences",
        f"per rank per step, {args.steps} steps of which {timed} timed, {args.repeats} alternating",
        f"runs each, medians compared. Machine: {platform.processor() or platform.machine()},"
        f" torch {torch.__version__}, Lightning {pl.__version__}.",
        "",
        "Wall clock: steps per second of rank 0, per run, median and best.",
        "",
        "| loop | steps/s per run | median | best |",
        "| --- | --- | --- | --- |",
        f"| hand-written OSS + ShardedDDP | {fmt(hand_rates)}"
        f" | {statistics.median(hand_rates):.2f} | {max(hand_rates):.2f} |",
        f"| Lightning DDPShardedStrategy | {fmt(pl_rates)}"
        f" | {statistics.median(pl_rates):.2f} | {max(pl_rates):.2f} |",
        "",
        f"**Ratio (strategy / hand-written), medians: {median_ratio:.3f}** (target >= 0.9);"
        f" best runs: {ratio:.3f}.",
        "",
        "CPU time: steps per CPU-second of rank 0's process (what the loop itself costs,"
        " insensitive to other processes taking the CPU):",
        "",
        "| loop | steps per CPU-second per run | median |",
        "| --- | --- | --- |",
        f"| hand-written OSS + ShardedDDP | {fmt(hand_cpu)} | {statistics.median(hand_cpu):.2f} |",
        f"| Lightning DDPShardedStrategy | {fmt(pl_cpu)} | {statistics.median(pl_cpu):.2f} |",
        "",
        f"**CPU-time ratio (strategy / hand-written), medians: {cpu_ratio:.3f}**.",
        "",
        f"Load average at the end ({os.cpu_count()} CPUs, shared): {load}. Under load the"
        " wall-clock runs vary; alternating them spreads the noise over both loops.",
        "",
        f"Largest relative difference of rank 0's per-step losses between the two: {loss_gap:.2e}.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
