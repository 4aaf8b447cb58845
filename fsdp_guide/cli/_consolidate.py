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
            "one full checkpoint file that loads at any world size. Runs in one process. Every "
            "field of the index and every file's SHA-256 are checked first, and the file written "
            "carries the SHA-256 of its contents. DST inside SRC, or one of its files, is "
            "refused before anything is written. Bad input: one line on stderr, exit status 2."
        ),
    )
    p.add_argument("source", metavar="SRC", help="sharded checkpoint directory")
    p.add_argument("target", metavar="DST", help="full checkpoint file to write")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from fsdp_guide.checkpoint import CheckpointError, consolidate
    from fsdp_guide.cli import CommandError

    try:
        summary = consolidate(args.source, args.target)
    except (CheckpointError, ValueError) as exc:  # a bad checkpoint, or a DST that would harm it
        raise CommandError(str(exc)) from exc
    except OSError as exc:  # permissions, a vanished directory: the system's own words
        raise CommandError(f"{type(exc).__name__}: {exc}") from exc
    optimizer = "with optimizer state" if summary["optimizer"] else "model only"
    print(
        f"consolidated {summary['world_size']} {summary['strategy']} shards from {args.source} "
        f"into {args.target}: {summary['tensors']} model tensors, {summary['bytes']} bytes, "
        f"{optimizer}"
    )
    return 0
