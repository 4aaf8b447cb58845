"""Time ``fsdp_guide.launch`` of a no-op on 2 gloo ranks against ``torch.multiprocessing.spawn``.

Both sides do the same work per rank: join a gloo process group, run a function that returns
at once, destroy the group. Measured in one run, interleaved, median of several repeats, so
the ratio holds on a noisy shared machine. Targets: forked launch at least 5x faster than
spawn, and within 1.1x of a bare fork (the same work in two forked processes, joined).

Usage::

    python benchmarks/launch_overhead.py [--repeats 5] [--out benchmarks/results/launch_overhead.md]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_guide import dist_init, find_free_port, launch

WORLD_SIZE = 2


def noop(rank: int, world_size: int) -> None:
    """The function both launchers run."""
    return None


def spawn_entry(rank: int, world_size: int, port: int) -> None:
    """What mp.spawn runs: the same process-group setup launch does, then the no-op."""
    dist_init(rank, world_size, backend="gloo", master_port=port)
    noop(rank, world_size)
    dist.destroy_process_group()


def time_launch(start_method: str) -> float:
    t0 = time.perf_counter()
    launch(noop, WORLD_SIZE, backend="gloo", start_method=start_method)  # type: ignore[arg-type]
    return time.perf_counter() - t0


def time_bare_fork() -> float:
    """The floor for a forked launch: two forked processes doing the same work, joined."""
    ctx = multiprocessing.get_context("fork")
    port = find_free_port()
    t0 = time.perf_counter()
    ranks = [ctx.Process(target=spawn_entry, args=(r, WORLD_SIZE, port)) for r in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    return time.perf_counter() - t0


def time_mp_spawn() -> float:
    t0 = time.perf_counter()
    mp.spawn(spawn_entry, args=(WORLD_SIZE, find_free_port()), nprocs=WORLD_SIZE, join=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/launch_overhead.md"))
    args = parser.parse_args()

    times: dict[str, list[float]] = {
        "launch (fork)": [],
        "bare fork": [],
        "launch (spawn)": [],
        "mp.spawn": [],
    }
    time_launch("fork")  # warm-up: first fork pays for page-table copies of a cold process
    for _ in range(args.repeats):
        times["launch (fork)"].append(time_launch("fork"))
        times["bare fork"].append(time_bare_fork())
        times["launch (spawn)"].append(time_launch("spawn"))
        times["mp.spawn"].append(time_mp_spawn())
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["mp.spawn"] / med["launch (fork)"]
    over_bare = med["launch (fork)"] / med["bare fork"]
    lines = [
        "# Launch overhead: a no-op on 2 gloo ranks",
        "",
        f"Median of {args.repeats} interleaved repeats, one run "
        "(`python benchmarks/launch_overhead.py`). Each rank joins a gloo process group, "
        "runs a function that returns at once, and leaves.",
        "",
        "| launcher | median (s) | min (s) | max (s) | mp.spawn / this |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, values in times.items():
        lines.append(
            f"| {name} | {med[name]:.3f} | {min(values):.3f} | {max(values):.3f} "
            f"| {med['mp.spawn'] / med[name]:.1f}x |"
        )
    verdict = "met" if ratio >= 5 else "NOT met"
    bare_verdict = "met" if over_bare <= 1.1 else "NOT met"
    lines += [
        "",
        f"Forked launch is **{ratio:.1f}x** faster than mp.spawn (target >= 5x: {verdict}).",
        f"It takes **{over_bare:.2f}x** the time of a bare fork, two forked processes doing "
        f"the same work with no relay, supervision or process-tree guard (target <= 1.1x: "
        f"{bare_verdict}).",
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
