"""Causal ring attention, naive against zigzag: each rank's compute on one time axis.

Each of ``c`` gloo ranks runs causal ring attention (forward and backward) on its share of
one sequence, cut in ``c`` consecutive chunks (naive) or zigzag (chunks ``r`` and
``2c - 1 - r`` of ``2c``), and records when each ring step's attention compute starts and
ends (``record_ring_steps``; ``time.perf_counter`` is the same clock in every process of a
Linux machine). The ranks start together (a barrier) and the call ends when the last rank
is done: every other rank's time until then is idle. The table gives each layout's time
and each rank's idle share, the median of ``--repeats`` calls; the figure shows one call of
each layout, rank by rank. One thread per rank, ranks <= cores, so that a rank waiting does
not lend its core to a busy one.

Usage::

    python benchmarks/ring_balance.py [--ranks 2] [--seq-len 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docs" / "_scripts" / "figures"))

from fsdp_guide import launch  # noqa: E402
from fsdp_guide.parallel import (  # noqa: E402
    plot_ring_steps,
    record_ring_steps,
    ring_attention,
    ring_schedule,
    shard_sequence,
)

LAYOUTS = ("naive", "zigzag")
HEADS, HEAD_DIM = 4, 64


def timed_calls(
    rank: int, world_size: int, seq_len: int, repeats: int
) -> dict[str, list[list[Any]]]:
    """On a launched rank: ``repeats`` causal ring attentions per layout, each call's steps."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq_len, HEAD_DIM, generator=g) for _ in range(3))
    calls: dict[str, list[list[Any]]] = {}
    for layout in LAYOUTS:
        mine = [shard_sequence(t, rank, world_size, layout, dim=2) for t in (q, k, v)]  # type: ignore[arg-type]
        calls[layout] = []
        for _ in range(repeats + 1):  # the first call warms up
            local = [t.clone().requires_grad_() for t in mine]
            dist.barrier()
            with record_ring_steps() as events:
                out = ring_attention(*local, causal=True, layout=layout)  # type: ignore[arg-type]
                out.sum().backward()
            calls[layout].append(list(events))
            dist.barrier()
        calls[layout] = calls[layout][1:]
    return calls


def _wall(ranks: list[list[Any]]) -> tuple[float, float]:
    """(first start, last end) of one call over every rank."""
    return min(e.start for r in ranks for e in r), max(e.end for r in ranks for e in r)


def compute_bound(ranks: list[list[Any]]) -> float:
    """The call's length on cores of its own: each ring step as long as its busiest rank's
    CPU time, the steps one after the other (what a loaded machine's wall clock blurs)."""
    steps: dict[tuple[str, int], float] = {}
    for events in ranks:
        for e in events:
            steps[e.phase, e.step] = max(steps.get((e.phase, e.step), 0.0), e.cpu)
    return sum(steps.values())


def summarize(results: list[dict[str, Any]], layout: str) -> dict[str, Any]:
    """Median wall time, compute-bound time and each rank's idle share over the repeats."""
    repeats = len(results[0][layout])
    times, bound, idle = [], [], [[] for _ in results]
    for i in range(repeats):
        ranks = [r[layout][i] for r in results]
        start, end = _wall(ranks)
        times.append(end - start)
        bound.append(compute_bound(ranks))
        for rank, events in enumerate(ranks):
            busy = sum(e.end - e.start for e in events)
            idle[rank].append(1 - busy / (end - start))
    return {
        "time": statistics.median(times),
        "bound": statistics.median(bound),
        "idle": [statistics.median(x) for x in idle],
        "median_call": sorted(range(repeats), key=lambda i: times[i])[repeats // 2],
    }


def figure(results: list[dict[str, Any]], summary: dict[str, dict[str, Any]]) -> Any:
    """The median call of each layout, rank by rank (``plot_ring_steps``)."""
    calls = {
        layout: [r[layout][summary[layout]["median_call"]] for r in results] for layout in LAYOUTS
    }
    return plot_ring_steps(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "ring_balance.md")
    args = parser.parse_args()
    results = launch(
        timed_calls, args.ranks, args=(args.seq_len, args.repeats), start_method="fork"
    )
    summary = {layout: summarize(results, layout) for layout in LAYOUTS}
    from style import to_svg

    svg = args.out.with_suffix(".svg")
    svg.write_text(to_svg(figure(results, summary)))
    c = args.ranks
    planned = {
        layout: sum(max(col) for col in zip(*ring_schedule(c, layout), strict=True))
        for layout in LAYOUTS
    }
    load = os.getloadavg()[0]
    lines = [
        "# Causal ring attention: the naive cut against the zigzag cut",
        "",
        f"Causal ring attention, forward and backward, on {c} gloo ranks of one CPU "
        f"({os.cpu_count()} cores, one thread per rank, load average {load:.1f} when the run "
        f"ended); one sequence of {args.seq_len} tokens, {HEADS} heads of {HEAD_DIM}; median of "
        f"{args.repeats} calls, one run (`python benchmarks/ring_balance.py`). *Wall* is the "
        "call's time from the ranks' common start to the last rank's end; *compute-bound* "
        "adds up, step by step, the busiest rank's CPU time (the call's length on cores of its "
        "own, which a loaded machine's wall clock blurs); *planned* is the ring's length in "
        "blocks of `(seq_len / c)²` query-key pairs (`ring_schedule`); *idle* is the share of "
        "the wall time a rank spends waiting.",
        "",
        "| layout | wall (ms) | vs zigzag | compute-bound (ms) | vs zigzag | planned (blocks) "
        "| vs zigzag | " + " | ".join(f"rank {r} idle" for r in range(c)) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in range(c))
        + " |",
    ]
    zig = summary["zigzag"]
    for layout in LAYOUTS:
        s = summary[layout]
        lines.append(
            f"| {layout} | {s['time'] * 1e3:.0f} | {s['time'] / zig['time']:.2f}x | "
            f"{s['bound'] * 1e3:.0f} | {s['bound'] / zig['bound']:.2f}x | {planned[layout]:g} | "
            f"{planned[layout] / planned['zigzag']:.2f}x | "
            + " | ".join(f"{x:.0%}" for x in s["idle"])
            + " |"
        )
    lines += [
        "",
        f"![Each rank's ring steps on one time axis, naive above zigzag]({svg.name})",
        "",
        "With the naive cut, rank 0's queries see only its own chunk, so it computes one "
        f"block per pass and waits while rank {c - 1} computes {c}; the zigzag cut gives every "
        "rank one early and one late chunk, and every rank the same work at every step.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
