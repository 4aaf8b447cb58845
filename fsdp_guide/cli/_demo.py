"""``python -m fsdp_guide demo``: launch a few gloo ranks and show their output."""

from __future__ import annotations

import argparse
from typing import Any

from fsdp_guide.cli._args import MAX_LOCAL_RANKS, int_at_least


def add_parser(sub: Any) -> None:
    """Register the ``demo`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="launch ranks on gloo, all-reduce, print what each saw"
    )
    p.add_argument(
        "--world-size",
        type=int_at_least(1, MAX_LOCAL_RANKS),
        default=2,
        help=f"ranks to start on this machine, at most {MAX_LOCAL_RANKS}; default 2",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from fsdp_guide._examples import hello
    from fsdp_guide.launcher import launch

    results = launch(hello, world_size=args.world_size, backend="gloo")
    print(f"launched {len(results)} ranks; rank sums: {[r['rank_sum'] for r in results]}")
    return 0
