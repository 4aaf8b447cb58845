"""``python -m fsdp_guide compare``: train the demo model under each strategy, measure memory.

For every strategy and rank it prints the bytes of model state measured after the last
``optimizer.step()``, the ZeRO prediction for the same setting, their ratio, the payload
bytes of the collectives the rank issued in the last step next to
:func:`~fsdp_guide.memory.predict_communication`, and the time per step.
This is the project's main job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, get_args

from fsdp_guide.cli._args import MAX_LOCAL_RANKS, MAX_TOKENS, int_at_least, strategy_list
from fsdp_guide.models import ModelName


def add_parser(sub: Any) -> None:
    """Register the ``compare`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "compare",
        help="train under each sharding strategy; per-rank memory measured vs ZeRO",
        description="Train the demo model for a few steps under each strategy (gloo on CPU) "
        "and print, per strategy and rank, the model-state bytes measured after "
        "optimizer.step(), the ZeRO prediction, their ratio, the bytes of collectives issued "
        "in the last step next to their prediction, and the time per step.",
    )
    p.add_argument(
        "--world-size",
        type=int_at_least(1, MAX_LOCAL_RANKS),
        default=2,
        help="ranks per run (default 2)",
    )
    p.add_argument("--model", choices=get_args(ModelName), default="transformer")
    p.add_argument(
        "--steps", type=int_at_least(1), default=3, help="training steps per strategy (default 3)"
    )
    p.add_argument(
        "--batch-size",
        type=int_at_least(1, MAX_TOKENS),
        default=8,
        help="global batch size (default 8)",
    )
    p.add_argument(
        "--strategies",
        type=strategy_list,
        default=None,
        help="comma-separated names (default: ddp,oss,sharded_ddp,fsdp,fsdp2, plus "
        "fairscale_fsdp with a GPU per rank); all: " + ", ".join(_strategy_names()),
    )
    p.add_argument(
        "--no-comm",
        dest="comm",
        action="store_false",
        help="do not count the collectives of the last step (the comm/step column)",
    )
    p.add_argument(
        "--wrap",
        choices=("blocks", "root"),
        default="blocks",
        help="FSDP's units: a unit per transformer block (default), or the whole model one unit",
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="write a bar chart (PNG)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=_run)


def _strategy_names() -> list[str]:
    from fsdp_guide.catalog import STRATEGIES

    return list(STRATEGIES)


def _default_strategies(world_size: int) -> list[str]:
    from fsdp_guide.catalog import DEFAULT_STRATEGIES, STRATEGIES
    from fsdp_guide.launcher import visible_gpus

    # The CUDA-only ones run on NCCL with one GPU per rank: added where there are enough GPUs.
    gpus = visible_gpus()
    cuda = [name for name, spec in STRATEGIES.items() if spec.needs_cuda]
    return [*DEFAULT_STRATEGIES, *(cuda if gpus >= world_size else [])]


def _check_output_path(option: str, path: str) -> None:
    """Refuse, before anything runs, an output file that could not be written afterwards."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path!r} is a directory; give a file name, e.g. out.json")
    if not target.parent.is_dir():
        raise ValueError(
            f"{option} {path!r}: directory {str(target.parent)!r} does not exist; create it "
            "or choose another path"
        )
    if option == "--plot" and target.suffix:
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if target.suffix[1:].lower() not in formats:
            raise ValueError(
                f"--plot {path!r}: matplotlib cannot write {target.suffix!r} files; "
                "use a .png (or .svg, .pdf) name"
            )


def _run(args: argparse.Namespace) -> int:
    from fsdp_guide.compare import comparison_table, plot_comparison, rows_as_json, run_comparison
    from fsdp_guide.errors import CommandError, LaunchError

    try:
        world_size, steps, batch_size = args.world_size, args.steps, args.batch_size
        names = args.strategies if args.strategies is not None else _default_strategies(world_size)
        for option, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                _check_output_path(option, path)
        # run_comparison checks everything else before it starts a process.
        rows = run_comparison(
            names, world_size, args.model, steps, batch_size, comm=args.comm, wrap=args.wrap
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    except LaunchError as exc:
        print(f"fsdp_guide compare: a run failed: {exc}")
        return 1
    print()
    print(f"Model state per rank after optimizer.step(), {args.model}, fp32 Adam, ", end="")
    print(f"{world_size} rank(s); predicted = ZeRO formula for the state held at that point:")
    print(comparison_table(rows, style="plain"))
    if args.comm:
        print(
            "comm/step: payload bytes of the collectives the rank issued in the last step "
            "(the tensor all-reduced, the full tensor gathered or reduce-scattered; * = "
            "collectives from other threads missed); comm pred: predict_communication. The "
            "ZeRO paper counts an all-reduce twice (2x payload); --json has both, per kind."
        )
        if steps < 3:
            print("note: with fewer than 3 steps, DDP's bucket rebuild (step 2) is counted too")
    print()
    for name in dict.fromkeys(row.strategy for row in rows):
        mine = [row for row in rows if row.strategy == name]
        peak = max(row.peak_bytes for row in mine) / 1e6
        what = (
            "CUDA peak allocated"
            if mine[0].peak_kind == "cuda_peak_allocated"
            else ("process peak RSS, not model state")
        )
        print(f"{name}: loss {mine[0].loss:.4f} (rank 0); peak {peak:.0f} MB ({what})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows_as_json(rows), f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        plot_comparison(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0
