"""Activation memory and step time of the demo transformer with and without checkpointing.

For each batch size: bytes autograd saves for backward (``saved_activation_bytes``) and the
median time of a forward+backward step, for the plain model and with every Block
checkpointed by PyTorch's and by FairScale's implementation. One process, CPU, measured in
one run with the variants interleaved, so the ratios hold on a noisy shared machine.

Usage::

    python benchmarks/activation_checkpointing.py [--repeats 5] [--batch-sizes 8 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, loss_fn, synthetic_batch
from fsdp_guide.wrap import checkpoint_layers, saved_activation_bytes

CONFIG = TransformerConfig()  # the lessons' default: 4 blocks, dim 128, seq_len 32
VARIANTS = ("plain", "torch", "fairscale")


def build(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    if variant != "plain":
        checkpoint_layers(model, Block, implementation=variant)  # type: ignore[arg-type]
    return model


def step_seconds(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    loss_fn(model, batch).backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/activation_checkpointing.md")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for batch_size in args.batch_sizes:
        batch = synthetic_batch("transformer", batch_size, config=CONFIG)
        models = {variant: build(variant) for variant in VARIANTS}
        saved = {}
        for variant, model in models.items():
            nbytes, loss = saved_activation_bytes(model, lambda m=model, b=batch: loss_fn(m, b))
            loss.backward()
            saved[variant] = nbytes
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(args.repeats):
            for variant, model in models.items():
                times[variant].append(step_seconds(model, batch))
        base = statistics.median(times["plain"])
        for variant in VARIANTS:
            median = statistics.median(times[variant])
            rows.append(
                f"| {batch_size} | {variant} | {saved[variant] / 2**20:.2f} | "
                f"{saved['plain'] / saved[variant]:.2f}x | {median * 1e3:.1f} | "
                f"{median / base:.2f}x |"
            )

    text = "\n".join(
        [
            "# Activation checkpointing: saved activations and step time",
            "",
            f"TinyTransformer (default config: {CONFIG.n_layers} blocks, dim {CONFIG.dim}, "
            f"seq_len {CONFIG.seq_len}), every Block checkpointed; one CPU thread; median of "
            f"{args.repeats} interleaved forward+backward steps, one run "
            "(`python benchmarks/activation_checkpointing.py`). Saved bytes are the tensors "
            "autograd keeps for backward (parameters excluded), each storage once.",
            "",
            "| batch | variant | saved (MiB) | plain / this | step (ms) | this / plain |",
            "| ---: | --- | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            "Checkpointing keeps only each block's input, so saved activations shrink by the "
            "ratio shown, whatever the batch size; the price is one more forward per block "
            "during backward.",
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
