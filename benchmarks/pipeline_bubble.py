"""The pipeline bubble measured on gloo ranks, next to the textbook ``(p - 1) / (v m + p - 1)``.

A uniform model (8 identical transformer blocks, float inputs, mean squared error) is cut
into ``p`` stages and trained with torch's schedules (``fsdp_guide.parallel.build_pipeline``)
on ``p`` forked CPU ranks, one thread each. Every action of each step is timed on the rank
that runs it (``time.perf_counter``, one clock for the machine's processes); a rank's
bubble is the share of the step's span in which it runs none: waiting for a neighbour's
message, sending, or idle. The table gives, per setting, the median over the measured steps
of the mean over ranks (and the least and most idle rank), next to the formula and to the
schedule's own actions placed with the step's measured forward and backward times (what
equal stages and free messages would give).

GPipe and 1F1B at ``p`` = 2 and 4 and ``m`` = 1, 2, 4, 8 (torch's 1F1B refuses ``m < p``);
Interleaved 1F1B (``v`` = 2), Interleaved Zero Bubble and ZBV at ``p`` = 2. The measured bubble
is a timing: it varies with the machine and its load. With more ranks than free cores the
ranks' compute slows down whenever more of them run at once, which the formula does not know;
and every message a rank waits for costs it a wake-up, which on cores busy with other
processes is a scheduler time slice, so there the measured bubble grows with the number of
micro-batches (messages) instead of falling. The load average is written beside the table.

Usage::

    python benchmarks/pipeline_bubble.py [--steps 6] [--out benchmarks/results/pipeline_bubble.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_guide import launch
from fsdp_guide.errors import PlanError
from fsdp_guide.memory import PipelineAction, pipeline_schedule
from fsdp_guide.parallel import ParallelBlock, build_pipeline

LAYERS, DIM, HEADS, HIDDEN, SEQ, BATCH = 8, 128, 4, 512, 32, 32
SETTINGS = [
    *[("GPipe", p, m) for p in (2, 4) for m in (1, 2, 4, 8)],
    *[("1F1B", p, m) for p in (2, 4) for m in (1, 2, 4, 8)],
    *[
        (name, 2, m)
        for name in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
        for m in (2, 4, 8)
    ],
]


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(ParallelBlock(DIM, HEADS, HIDDEN) for _ in range(LAYERS)))


def run_rank(rank: int, world_size: int, schedule: str, microbatches: int, steps: int) -> Any:
    """Train ``steps + 1`` steps; return the timeline of each step after the first."""
    pipeline = build_pipeline(build(), schedule=schedule, microbatches=microbatches)
    optimizer = torch.optim.Adam(pipeline.modules.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)
    timelines = []
    for step in range(steps + 1):
        torch.distributed.barrier()
        pipeline.step(x, y)
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first step also sets the pipeline up
            timelines.append(list(pipeline.timeline))
    return timelines


def measure(schedule: str, p: int, m: int, steps: int) -> dict[str, Any] | str:
    try:
        actions = pipeline_schedule(schedule, ranks=p, microbatches=m)
    except PlanError:
        return "refused by torch (m < p)"
    ranks = launch(run_rank, world_size=p, args=(schedule, m, steps), start_method="fork")
    means, lows, highs, simulated = [], [], [], []
    for step in range(steps):
        records = [ranks[r][step] for r in range(p)]
        idle = actions.bubble(records)
        means.append(statistics.mean(idle))
        lows.append(min(idle))
        highs.append(max(idle))
        costs: dict[str, list[float]] = {}
        for rank in records:
            for action, start, end in rank:
                kind = PipelineAction.parse(action).kind
                costs.setdefault(kind, []).append(end - start)
        cost = {k: statistics.median(v) for k, v in costs.items()}
        timed = actions.timeline(
            forward=cost.get("F", 1.0),
            backward=cost.get("B", 2.0),
            backward_input=cost.get("I", 1.0),
            backward_weight=cost.get("W", 1.0),
        )
        simulated.append(statistics.mean(actions.bubble(timed)))
    return {
        "v": actions.stages_per_rank,
        "formula": actions.formula_bubble,
        "simulated": statistics.median(simulated),
        "measured": statistics.median(means),
        "low": statistics.median(lows),
        "high": statistics.median(highs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per setting")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_bubble.md"))
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    rows = []
    for schedule, p, m in SETTINGS:
        found = measure(schedule, p, m, args.steps)
        rows.append((schedule, p, m, found))
        print(schedule, p, m, found, flush=True)
    cores = os.cpu_count()
    lines = [
        "# Pipeline bubble: measured on gloo ranks next to (p - 1) / (v m + p - 1)",
        "",
        f"`python benchmarks/pipeline_bubble.py` (torch {torch.__version__}, {cores} CPU cores, "
        f"one thread per rank, {args.steps} measured steps per setting, "
        f"{time.perf_counter() - t0:.0f} s, load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end). A model of {LAYERS} identical transformer blocks "
        f"(width {DIM}, MLP {HIDDEN}) on a batch of {BATCH} x {SEQ} tokens, cut into `p · v` "
        "stages. A rank's bubble is the share of the step in which it runs no forward or "
        "backward; the table shows the mean over ranks (the least and the most idle rank in "
        "brackets), the median over steps. *Simulated*: the schedule's own actions placed "
        "with this step's median forward and backward times, messages free. Each message a "
        "rank waits for costs it a wake-up; on cores busy with other processes that is a "
        "scheduler time slice, and the measured bubble then grows with the micro-batches.",
        "",
        "| schedule | p | v | m | formula | simulated | measured (min-max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for schedule, p, m, found in rows:
        if isinstance(found, str):
            lines.append(f"| {schedule} | {p} | 1 | {m} | | | {found} |")
            continue
        lines.append(
            f"| {schedule} | {p} | {found['v']} | {m} | {found['formula']:.3f} | "
            f"{found['simulated']:.3f} | {found['measured']:.3f} "
            f"({found['low']:.3f}-{found['high']:.3f}) |"
        )
    lines += ["", _verdict(rows, cores or 1)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


def _verdict(rows: list[tuple[str, int, int, Any]], cores: int) -> str:
    """What the table shows, in words computed from it."""
    measured = {(s, p, m): f for s, p, m, f in rows if not isinstance(f, str)}
    gaps = [
        abs(f["measured"] - f["formula"])
        for (s, p, _), f in measured.items()
        if s in ("GPipe", "1F1B") and p <= cores
    ]
    worst = max(gaps) if gaps else float("nan")
    falls = all(
        measured[(s, p, 1 if s == "GPipe" else p)]["measured"] > measured[(s, p, 8)]["measured"]
        for s in ("GPipe", "1F1B")
        for p in (2, 4)
        if (s, p, 8) in measured and (s, p, 1 if s == "GPipe" else p) in measured
    )
    inter = measured.get(("Interleaved1F1B", 2, 8))
    plain = measured.get(("1F1B", 2, 8))
    parts = [
        f"With as many ranks as cores (p <= {cores}), GPipe and 1F1B measure within "
        f"{worst:.3f} of the formula.",
        "The bubble falls as micro-batches are added, for every schedule and p: "
        f"{'yes' if falls else 'NO'}.",
    ]
    if inter and plain:
        parts.append(
            f"At p = 2, m = 8, Interleaved 1F1B (v = 2) measures {inter['measured']:.3f} "
            f"against 1F1B's {plain['measured']:.3f} "
            f"(ratio {plain['measured'] / inter['measured']:.2f}; the formula's "
            f"{plain['formula'] / inter['formula']:.2f})."
        )
    return " ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
