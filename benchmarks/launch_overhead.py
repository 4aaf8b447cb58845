"""Time ``fsdp_guide.launch`` of a no-op on 2 gloo ranks against a bare fork, ``mp.spawn`` and
Accelerate's ``notebook_launcher``.

Every side does the same work per rank: join a gloo process group, run a function that
returns at once, destroy the group. Measured in one run, interleaved, median of several
repeats, so the ratios hold on a noisy shared machine. Targets: forked launch within 1.1x
of a bare fork (the same work in two forked processes, joined), at least 2.5x faster than
Accelerate's ``notebook_launcher`` (forked ranks under torch's elastic agent), and at least
5x faster than ``torch.multiprocessing.spawn``. Without Accelerate installed its row is
left out, and the output says so.

Usage::

    python benchmarks/launch_overhead.py [--repeats 9] [--out benchmarks/results/launch_overhead.md]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_guide.launcher import dist_init, find_free_port, launch

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
    elapsed = time.perf_counter() - t0
    if any(process.exitcode for process in ranks):
        raise RuntimeError(f"a bare-fork rank exited with {[p.exitcode for p in ranks]}")
    return elapsed


def accelerate_entry() -> None:
    """What Accelerate's launcher runs: the group from the environment its agent sets."""
    dist.init_process_group("gloo")
    noop(dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()


def time_accelerate() -> float:
    from accelerate import notebook_launcher

    port = str(find_free_port())
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its "Launching training on 2 CPUs."
        notebook_launcher(accelerate_entry, num_processes=WORLD_SIZE, use_port=port)
    return time.perf_counter() - t0


def time_mp_spawn() -> float:
    t0 = time.perf_counter()
    mp.spawn(spawn_entry, args=(WORLD_SIZE, find_free_port()), nprocs=WORLD_SIZE, join=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/launch_overhead.md"))
    parser.add_argument(
        "--no-spawn", action="store_true", help="leave out the spawned rows (the slow ones)"
    )
    args = parser.parse_args()

    timers = {
        "launch (fork)": lambda: time_launch("fork"),
        "bare fork": time_bare_fork,
        "Accelerate notebook_launcher": time_accelerate,
        "launch (spawn)": lambda: time_launch("spawn"),
        "mp.spawn": time_mp_spawn,
    }
    if args.no_spawn:
        del timers["launch (spawn)"], timers["mp.spawn"]
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if not has_accelerate:
        del timers["Accelerate notebook_launcher"]
        print("Accelerate is not installed: its notebook_launcher row is left out.")
    times: dict[str, list[float]] = {name: [] for name in timers}
    # Warm-up: the first fork pays for page-table copies of a cold process, the first
    # Accelerate launch for its imports.
    time_launch("fork")
    if has_accelerate:
        time_accelerate()
    failed: list[str] = []
    for _ in range(args.repeats):
        for name, timer in timers.items():
            times[name].append(_timed(name, timer, failed))
    med = {k: statistics.median(v) for k, v in times.items()}
    fork = med["launch (fork)"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "# Launch overhead: a no-op on 2 gloo ranks",
        "",
        f"Median of {args.repeats} interleaved repeats, one run "
        "(`python benchmarks/launch_overhead.py`) on "
        f"{cores} CPU cores ({platform.python_version()}, torch {torch_version()}). Each rank "
        "joins a gloo process group, runs a function that returns at once, and leaves.",
        "",
        "| launcher | median (s) | min (s) | max (s) | this / launch (fork) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, values in times.items():
        lines.append(
            f"| {name} | {med[name]:.3f} | {min(values):.3f} | {max(values):.3f} "
            f"| {med[name] / fork:.2f}x |"
        )
    over_bare = fork / med["bare fork"]
    lines += [
        "",
        f"- Forked launch takes **{over_bare:.2f}x** the time of a bare fork, two forked "
        "processes doing the same work with no relay, supervision or process-tree care "
        f"(target <= 1.1x: {_verdict(over_bare <= 1.1)}).",
    ]
    if has_accelerate:
        over_accelerate = med["Accelerate notebook_launcher"] / fork
        lines.append(
            f"- It is **{over_accelerate:.1f}x** faster than Accelerate's notebook_launcher "
            f"(target >= 2.5x: {_verdict(over_accelerate >= 2.5)})."
        )
    else:
        lines.append("- Accelerate is not installed: its notebook_launcher was not measured.")
    if "mp.spawn" in med:
        over_spawn = med["mp.spawn"] / fork
        lines.append(
            f"- It is **{over_spawn:.1f}x** faster than mp.spawn "
            f"(target >= 5x: {_verdict(over_spawn >= 5)})."
        )
    if failed:
        lines.append(
            f"- {len(failed)} run(s) failed and were repeated (gloo's connection setup under "
            "load fails now and then, whichever launcher starts the ranks): "
            + "; ".join(sorted(set(failed)))
        )
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


def _timed(name: str, timer: Callable[[], float], failed: list[str], tries: int = 3) -> float:
    """``timer()``, repeated when a run fails (each failure noted in ``failed``)."""
    for attempt in range(tries):
        try:
            return timer()
        except Exception as exc:  # a failed run is reported, and timed again
            failed.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            if attempt == tries - 1:
                raise
    raise AssertionError("not reached")


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
