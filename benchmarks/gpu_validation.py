"""The GPU validation of issue 17 in one script: tests, notebooks, strategies, memory.

Each step runs as a subprocess with its own time limit; the script records its command,
return code, passed/failed/skipped counts (pytest's summary line, or the same line printed
by the script's own steps) and wall time, and writes a markdown report (device, driver,
torch and CUDA versions, each command with its result and time, failures with the tail of
their output) and a JSON file that later calls can be merged with.

Steps (``--step NAME``, repeatable; ``--all``, the default, runs them in this order):

- ``pytest``: ``python -m pytest -m gpu -q -rfEs --continue-on-collection-errors tests``,
  every CUDA-marked test (a module that fails to import does not stop the others); among
  them ``tests/gpu/test_strategies_gpu.py``, ``DDPFullyShardedStrategy`` at ``devices=1`` in
  each mode that seeds 000 and 002 describe.
- ``fairscale``: ``gpu/fairscale_checks.py``, ``shard(engine="fairscale")`` trained at world
  size 1 on NCCL through ``fsdp_guide.launch``, and ``fsdp_guide.checkpoint`` save/load
  round trips (full and sharded) for FairScale FSDP.
- ``memory``: ``gpu/memory_checks.py``, CUDA peak memory of a 303,360,000-parameter
  TinyTransformer against the predicted model state plus the measured saved activations.
- ``notebooks``: every notebook in ``notebooks/`` executed top to bottom with nbclient
  (``gpu/_notebooks.py``), one subprocess per notebook, cells tagged ``skip-execution``
  included; the executed copies are written to ``<work-dir>/executed/``.

Usage, from the repository root (see ``benchmarks/gpu_run.md`` for the GPU machine)::

    PYTHONPATH=$PWD python benchmarks/gpu_validation.py --dry-run
    PYTHONPATH=$PWD python benchmarks/gpu_validation.py --step pytest --step fairscale
    PYTHONPATH=$PWD python benchmarks/gpu_validation.py --merge a.json b.json
    PYTHONPATH=$PWD python benchmarks/gpu_validation.py --copy-cuda-outputs DIR --from-json a.json

Run by path, as above: Python then puts ``benchmarks/`` first on ``sys.path``, where the
package ``gpu`` is found (here, in the steps that run this script again with
``--internal``, and in the ranks they spawn, which inherit ``sys.path``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu import _machine, _notebooks, _report, _runner, _steps
from gpu._paths import DEFAULT_RESULTS, DEFAULT_WORK_DIR
from gpu.fairscale_checks import fairscale_checks
from gpu.memory_checks import memory_checks

# The budget counts from here: the environment probe before the steps takes time too.
STARTED = time.monotonic()

# What ``--internal NAME`` runs: a step of the plan (or the environment probe) in this process.
INTERNAL: dict[str, Callable[[argparse.Namespace], int]] = {
    "env": lambda args: _machine.probe(),
    "notebook": lambda args: _notebooks.run_notebook(
        Path(args.notebook[0]), args.work_dir, args.deadline
    ),
    "fairscale": lambda args: fairscale_checks(args.work_dir),
    "memory": lambda args: memory_checks(args.work_dir),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--step", action="append", choices=_steps.STEP_NAMES, help="a step (repeatable)"
    )
    what.add_argument("--all", action="store_true", help="every step (the default)")
    what.add_argument(
        "--notebook", action="append", default=[], help="only notebooks whose name starts so"
    )
    what.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--budget",
        type=float,
        default=_runner.DEFAULT_BUDGET,
        help="seconds from start to the last step's end",
    )
    limits.add_argument("--notebook-limit", type=float, default=_steps.NOTEBOOK_LIMIT)
    limits.add_argument("--jobs", type=int, default=3, help="notebooks run at once")
    out = parser.add_argument_group("output")
    out.add_argument(
        "--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="logs, executed notebooks"
    )
    out.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="markdown report")
    out.add_argument("--json", type=Path, default=None, help="this call's results (to merge)")
    out.add_argument("--archive", type=Path, default=None, help="logs + executed notebooks .tar.gz")
    out.add_argument("--call-label", default="1", help="names this call in the report")
    out.add_argument("--notes", type=Path, default=None, help="markdown for the Notes section")
    later = parser.add_argument_group("after the GPU run (no GPU needed)")
    later.add_argument("--merge", nargs="+", type=Path, help="JSON files of calls -> --results")
    later.add_argument("--copy-cuda-outputs", type=Path, metavar="EXECUTED_DIR")
    later.add_argument("--from-json", type=Path, help="a call's JSON naming the GPU, for the note")
    parser.add_argument("--internal", choices=list(INTERNAL), help=argparse.SUPPRESS)
    parser.add_argument(
        "--deadline", type=float, default=_steps.NOTEBOOK_LIMIT, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.json is None:
        args.json = args.work_dir / "gpu_validation.json"
    if args.all or not args.step:
        args.step = list(_steps.STEP_NAMES)
    return args


def print_plan(plan: Sequence[_steps.Step], args: argparse.Namespace) -> None:
    """The steps, commands and limits, without running anything."""
    print(f"GPU validation plan (budget {args.budget:.0f} s; notebooks {args.jobs} at a time)")
    print(f"work dir {args.work_dir}; report {args.results}; JSON {args.json}")
    for step in plan:
        mode = "parallel" if step.parallel else "serial"
        print(f"- {step.name} [{mode}, limit {step.limit:.0f} s]: {step.command}")
    total = sum(step.limit for step in plan)
    print(f"{len(plan)} steps; limits add up to {total:.0f} s (parallel notebooks overlap)")


def make_runner(
    args: argparse.Namespace, env: dict[str, Any], start: float = STARTED
) -> _runner.Runner:
    """The runner of ``args``' budget, counted from ``start``, and outputs."""
    return _runner.Runner(
        env,
        start=start,
        budget=args.budget,
        jobs=args.jobs,
        call=args.call_label,
        work_dir=args.work_dir,
        json_path=args.json,
        report=args.results,
        notes=args.notes,
    )


def run(args: argparse.Namespace) -> int:
    """Run the plan of ``args`` on this machine (or print it, with ``--dry-run``)."""
    try:
        notebooks = _notebooks.notebook_paths(args.notebook) if "notebooks" in args.step else []
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plan = _steps.build_plan(args.step, args.work_dir, notebooks, args.notebook_limit)
    if args.dry_run:
        print_plan(plan, args)
        return 0
    env = _machine.collect_environment()
    print(_report.environment_line(env), flush=True)
    runner = make_runner(args, env)
    if not env.get("cuda_available"):
        runner.write()  # the environment (and a probe error) still reach the JSON
        print(f"no CUDA device visible to torch ({env.get('probe_error', 'no error')}); stopping")
        return 2
    runner.run(plan)
    if args.archive is not None:
        _runner.pack(args.work_dir, args.archive)
    failed = [r.name for r in runner.results if r.status != "passed"]
    print(f"report: {args.results}; JSON: {args.json}; not passed: {failed or 'none'}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parse_args(argv)
    if args.internal:
        return INTERNAL[args.internal](args)
    if args.merge:
        env, results = _report.merge_reports([_report.read_json(p) for p in args.merge])
        _report.write_markdown(args.results, env, results, args.notes)
        print(f"wrote {args.results} ({len(results)} steps)")
        return 0
    if args.copy_cuda_outputs:
        env = _report.read_json(args.from_json)["environment"] if args.from_json else {}
        return _notebooks.copy_back(args.copy_cuda_outputs, _report.gpu_note(env))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
