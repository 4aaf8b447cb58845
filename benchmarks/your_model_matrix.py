"""Planned vs measured per rank on third-party models: state, activations, communication.

Run from the repository root (transformers installed, e.g. ``pip install -e ".[dev]"``):

    python benchmarks/your_model_matrix.py [--world-sizes 2 4] [--models gpt2 llama ...]

Tiny transformers models built from config classes (GPT-2 with tied embeddings, Llama with
grouped-query attention and an attention mask of ones, BERT with a padding mask, T5, ViT and
a ResNet) train three steps under each strategy on gloo ranks. Each rank measures, in the third
step, its model state after ``optimizer.step()``, the bytes autograd saved in the forward,
and the payload of each collective kind (under DDP, also what it sent once: at the wrap and
when it regroups its buckets); ``fsdp_guide.memory.plan`` plans the same rank
from a builder, without allocating the model. ``benchmarks/results/your_model_matrix.md``
gets the planned/measured ratio of every field (``=`` where equal to the byte or element,
``-`` where both are 0).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from hf_models import MODELS, measure_and_plan  # noqa: E402

from fsdp_guide.launcher import launch  # noqa: E402

STRATEGIES = ("ddp", "zero1", "sharded_ddp", "fsdp", "fsdp2", "deepspeed_zero3")
RESULTS = ROOT / "benchmarks" / "results" / "your_model_matrix.md"
FIELDS = ("state", "activations", "comm")


def _ratio(planned: int, measured: int) -> str:
    if planned == measured:
        return "=" if planned else "-"
    return f"{planned / measured:.4f}" if measured else f"{planned}/0"


def _cells(result: dict[str, dict[str, int]]) -> dict[str, str]:
    planned, measured = result["planned"], result["measured"]
    state = ("params", "grads", "optimizer", "buckets", "master")
    comm = sorted({k for k in (*planned, *measured) if k.startswith(("comm_", "once_"))})
    worst_state = [_ratio(planned[f], measured[f]) for f in state]
    worst_comm = [_ratio(planned.get(k, 0), measured.get(k, 0)) for k in comm]
    return {
        "state": ", ".join(
            f"{f} {r}" for f, r in zip(state, worst_state, strict=True) if r not in "=-"
        )
        or "=",
        "activations": _ratio(planned["activations"], measured["activations"]),
        "comm": ", ".join(
            f"{k.removeprefix('comm_')} {r}"
            for k, r in zip(comm, worst_comm, strict=True)
            if r not in "=-"
        )
        or "=",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    lines = [
        "# Planned / measured per rank on third-party models",
        "",
        f"`python benchmarks/your_model_matrix.py`, torch {torch.__version__}, "
        f"{platform.machine()}, gloo. Each cell: `=` when planned equals measured on every "
        "rank, else the ratio planned/measured of each differing field on the worst rank.",
        "",
        "| model | strategy | ranks | state | activations | communication |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    start = time.perf_counter()
    for world_size in args.world_sizes:
        for model in args.models:
            for strategy in args.strategies:
                results = launch(
                    measure_and_plan,
                    world_size,
                    args=(model, strategy),
                    backend="gloo",
                    start_method="fork",
                    timeout=600,
                )
                cells = [_cells(r) for r in results]
                merged = {
                    field: next((c[field] for c in cells if c[field] != "="), "=")
                    for field in FIELDS
                }
                row = (
                    f"| {model} | {strategy} | {world_size} | "
                    + " | ".join(merged[f] for f in FIELDS)
                    + " |"
                )
                print(row, flush=True)
                lines.append(row)
    sizes = ", ".join(str(w) for w in args.world_sizes)
    lines += [
        "",
        f"World sizes {sizes}: {time.perf_counter() - start:.0f} s in all, on this machine.",
        "State is parameters, gradients, optimizer state, buckets and master copy (bytes); "
        "activations the bytes autograd saved in the forward; communication the payload "
        "elements of each collective kind in the third step, and under DDP (ddp, zero1) what "
        "it sent once (the wrap's broadcasts, its buckets' new layout in the second step).",
    ]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
