"""``python -m fsdp_guide consolidate SRC DST``: a sharded checkpoint into one full file."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    """Register the ``consolidate`` command.

    Examples:
        >>> from fsdp_guide.cli import build_parser
        >>> build_parser().parse_args(["consolidate", "ckpt", "full.pt"]).target
        'full.pt'
    """
    p: argparse.ArgumentParser = sub.add_parser(
        "consolidate",
        help="stitch a sharded checkpoint directory into one full checkpoint file",
        description=(
            "Read a directory written by fsdp_guide.checkpoint.save(kind='sharded') and write "
            "one full checkpoint file that loads at any world size. Runs in one process."
        ),
    )
    p.add_argument("source", metavar="SRC", help="sharded checkpoint directory")
    p.add_argument("target", metavar="DST", help="full checkpoint file to write")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fsdp_guide.checkpoint import CheckpointError, consolidate
    from fsdp_guide.cli import CommandError

    if Path(args.target).is_dir():
        raise CommandError(f"DST {args.target} is a directory; give a file path such as full.pt")
    try:
        summary = consolidate(args.source, args.target)
    except CheckpointError as exc:
        raise CommandError(str(exc)) from exc
    optimizer = "with optimizer state" if summary["optimizer"] else "model only"
    print(
        f"consolidated {summary['world_size']} {summary['strategy']} shards from {args.source} "
        f"into {args.target}: {summary['tensors']} model tensors, {summary['bytes']} bytes, "
        f"{optimizer}"
    )
    return 0
