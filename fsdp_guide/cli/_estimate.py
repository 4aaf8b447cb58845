"""``python -m fsdp_guide estimate``: the ZeRO table of model-state bytes per GPU, every stage."""

from __future__ import annotations

import argparse
from typing import Any

_STAGES = (
    (0, "nothing", "ddp"),
    (1, "optimizer state", "oss/zero1"),
    (2, "+ gradients", "sharded_ddp"),
    (3, "+ parameters", "fsdp/fsdp2"),
)


def add_parser(sub: Any) -> None:
    """Register the ``estimate`` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "estimate",
        help="ZeRO estimate of model-state memory per GPU for every stage",
        description="Bytes of parameters, gradients and optimizer state per rank that the "
        "ZeRO formulas predict, for stages 0-3 (activations and buffers not included).",
    )
    # Checked in _run, not by argparse (required=True), so a missing count is one line too.
    p.add_argument("--params", default=None, help="parameter count, e.g. 7e9, 7B, 350M (required)")
    p.add_argument("--world-size", default="8", help="number of GPUs (ranks); default 8")
    p.add_argument("--precision", default="mixed", help="mixed (default) or fp32")
    p.add_argument("--optimizer", default="adam", help="adam (default), sgd or sgd_momentum")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GB: show what fits")
    p.set_defaults(func=_run)


def estimate_table(
    num_params: float,
    world_size: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    gpu_memory: int | None = None,
) -> str:
    """The table ``estimate`` prints: one line per ZeRO stage, in GB (10**9 bytes).

    Args:
        num_params: Parameters in the model.
        world_size: Ranks (GPUs) the state is sharded over.
        precision: ``"mixed"`` or ``"fp32"``.
        optimizer: ``"adam"``, ``"sgd"`` or ``"sgd_momentum"``.
        gpu_memory: Bytes per GPU; adds a column telling whether the model state fits.

    Raises:
        ValueError: For bad numbers, precision or optimizer.

    Examples:
        >>> print(estimate_table(7.5e9, 64, gpu_memory=32 * 10**9))  # ZeRO paper, Figure 1
        7.50B parameters on 64 ranks, mixed precision, adam: 2 + 2 + 12 bytes per parameter
        stage  shards           strategies   params    grads     optimizer  total      fits 32 GB
        0      nothing          ddp          15.00 GB  15.00 GB  90.00 GB   120.00 GB  no
        1      optimizer state  oss/zero1    15.00 GB  15.00 GB  1.41 GB    31.41 GB   yes
        2      + gradients      sharded_ddp  15.00 GB  0.23 GB   1.41 GB    16.64 GB   yes
        3      + parameters     fsdp/fsdp2   0.23 GB   0.23 GB   1.41 GB    1.88 GB    yes
    """
    from fsdp_guide.memory._zero import bytes_per_param, estimate_model_state, format_bytes

    per = bytes_per_param(precision, optimizer)  # type: ignore[arg-type]
    header = ["stage", "shards", "strategies", "params", "grads", "optimizer", "total"]
    if gpu_memory is not None:
        header.append(f"fits {gpu_memory / 1e9:.4g} GB")
    rows = [header]
    for stage, shards, names in _STAGES:
        state = estimate_model_state(num_params, world_size, stage, precision, optimizer)  # type: ignore[arg-type]
        cells = [str(stage), shards, names]
        cells += [format_bytes(b, "GB") for b in (state.params, state.grads, state.optimizer)]
        cells.append(format_bytes(state.total, "GB"))
        if gpu_memory is not None:
            cells.append("yes" if state.total <= gpu_memory else "no")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    title = (
        f"{num_params / 1e9:.2f}B parameters on {world_size} ranks, {precision} precision, "
        f"{optimizer}: {per.params} + {per.grads} + {per.optimizer} bytes per parameter"
    )
    return "\n".join([title, *lines])


def _run(args: argparse.Namespace) -> int:
    from fsdp_guide.cli import CommandError
    from fsdp_guide.cli._args import parse_count, parse_int
    from fsdp_guide.memory._zero import parse_size

    try:
        if args.params is None:
            raise ValueError("--params is required: the model's parameter count, e.g. --params 7e9")
        num_params = parse_count("--params", args.params)
        world_size = parse_int("--world-size", args.world_size, 1)
        gpu_memory = None if args.gpu_memory is None else parse_size(args.gpu_memory)
        if gpu_memory is not None and gpu_memory <= 0:
            raise ValueError(f"--gpu-memory must be positive, got {args.gpu_memory!r}")
        table = estimate_table(num_params, world_size, args.precision, args.optimizer, gpu_memory)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    print(table)
    print("Model state only: activations, communication buffers and fragmentation come on top.")
    return 0
