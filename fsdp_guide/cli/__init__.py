"""Command line: ``python -m fsdp_guide <command>``.

Each command lives in its own module and registers itself here through
:data:`_COMMANDS`; bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from fsdp_guide.errors import CommandError as CommandError  # documented in fsdp_guide.errors

# The command line is documented as commands (docs/cli.md), not as Python names.
__all__: list[str] = []

# Modules that define ``add_parser(subparsers)``; each sets ``func`` on its sub-parser.
_COMMANDS: tuple[str, ...] = (
    "fsdp_guide.cli._compare",
    "fsdp_guide.cli._estimate",
    "fsdp_guide.cli._consolidate",
    "fsdp_guide.cli._demo",
)


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (no usage block), status 2.

    Sub-command parsers inherit the class, so every command reports alike.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the parser with every registered command.

    Examples:
        >>> parser = build_parser()
        >>> parser.prog
        'fsdp_guide'
    """
    parser = _OneLineParser(
        prog="fsdp_guide",
        description="Sharded training in PyTorch, measured: compare strategies, estimate memory.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Examples:
        >>> main(["demo", "--world-size", "0"])
        2
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # the parser already printed its one-line error
        return int(exc.code or 0)
    try:
        status: int = args.func(args)
    except CommandError as exc:
        print(f"fsdp_guide {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return status
