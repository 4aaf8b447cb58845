"""The tables ``estimate`` prints, and the largest micro-batch that fits (private).

``estimate_table`` is the ZeRO formulas' table of ``--params``; ``plan_table`` one line per
planned strategy (its fullest rank) with the recommendation and its recipe;
``largest_batch`` the search behind ``--max-batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SHARDS = ("nothing", "optimizer state", "+ gradients", "+ parameters")


def _strategies_of_stage(stage: int) -> str:
    """Names of the catalog at a stage; variants of one mechanism (buckets, hybrid, offload) out."""
    from fsdp_guide.catalog import STRATEGIES

    names = [s.name for s in STRATEGIES.values() if s.zero_stage == stage and not s.variant_of]
    return ", ".join(names)


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
        stage  shards           strategies                                    params    grads ...
        0      nothing          ddp, fsdp_no_shard                            15.00 GB  15.00 GB ...
        1      optimizer state  zero1, oss, deepspeed_zero1                   15.00 GB  15.00 GB ...
        2      + gradients      sharded_ddp, fsdp_grad_op, deepspeed_zero2    15.00 GB  0.23 GB ...
        3      + parameters     fsdp, fsdp2, fairscale_fsdp, deepspeed_zero3  0.23 GB   0.23 GB ...
    """
    from fsdp_guide.compare import text_table
    from fsdp_guide.memory import bytes_per_param, estimate_model_state

    per = bytes_per_param(precision, optimizer)  # type: ignore[arg-type]
    header = ["stage", "shards", "strategies", "params", "grads", "optimizer", "total"]
    if gpu_memory is not None:
        header.append(f"fits {gpu_memory / 1e9:.4g} GB")
    rows = [header]
    for stage, shards in enumerate(_SHARDS):
        names = _strategies_of_stage(stage)
        state = estimate_model_state(num_params, world_size, stage, precision, optimizer)  # type: ignore[arg-type]
        cells = [str(stage), shards, names]
        cells += [readable(b, "GB") for b in (state.params, state.grads, state.optimizer)]
        cells.append(readable(state.total, "GB"))
        if gpu_memory is not None:
            cells.append("yes" if state.total <= gpu_memory else "no")
        rows.append(cells)
    title = (
        f"{_count(num_params)} parameters on {world_size} ranks, {precision} precision, "
        f"{optimizer}: {per.params} + {per.grads} + {per.optimizer} bytes per parameter"
    )
    return "\n".join([title, text_table(rows)])


def readable(num_bytes: float, unit: str) -> str:
    """``num_bytes`` in ``unit``, or in the unit that shows it when it is below 0.1 of it.

    A column in GB would print a few megabytes as ``0.00 GB`` or ``0.01 GB``; those cells
    switch to the unit that gives them three digits.

    Examples:
        >>> readable(2.5e9, "GB"), readable(12_000_000, "GB"), readable(0, "GB")
        ('2.50 GB', '12.00 MB', '0.00 GB')
    """
    from fsdp_guide.memory import format_bytes

    scale = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}.get(unit, 1)
    if num_bytes and abs(num_bytes) < 0.1 * scale:
        return format_bytes(num_bytes)
    return format_bytes(num_bytes, unit)


def _count(num_params: float) -> str:
    """``7.50B``, ``350.00M`` or ``9,000``: a parameter count with the digits that matter."""
    if num_params >= 1e9:
        return f"{num_params / 1e9:.2f}B"
    return f"{num_params / 1e6:.2f}M" if num_params >= 1e6 else f"{num_params:,.0f}"


def largest_batch(
    plan_at: Callable[[int], Any], gpu_memory: int, margin: float, host_memory: int | None
) -> int:
    """The largest batch size whose plan fits (0 when none does).

    A step's peak grows about linearly with the batch: the plans at 1 and 2 give the guess,
    which plans around it then settle (one trace per batch size tried, shared by the
    strategies that run the model alike).

    Examples:
        >>> from fsdp_guide.memory import plan
        >>> from fsdp_guide.models import MLP
        >>> mlp = MLP()
        >>> at = lambda b: plan(mlp, batch_size=b, seq_len=1, world_size=2, strategy="ddp")
        >>> budget = at(40).step_peak  # its optimizer step's: more samples still fit
        >>> best = largest_batch(at, budget, 0.0, None)
        >>> best >= 40, at(best).fits(budget, 0.0), at(best + 1).fits(budget, 0.0)
        (True, True, False)
    """
    seen: dict[int, Any] = {}

    def fits(batch: int) -> bool:
        if batch not in seen:
            seen[batch] = plan_at(batch)
        return bool(seen[batch].fits(gpu_memory, margin, host_memory=host_memory))

    if not fits(1):
        return 0
    if not fits(2):
        return 1
    one, two = seen[1].step_peak, seen[2].step_peak
    room = gpu_memory * (1 - margin)
    # lo fits, hi does not (or is past the search); the linear guess is the first probe.
    lo, hi = 2, MAX_BATCH + 1
    if two > one:
        guess = min(max(2 + int((room - two) // (two - one)), 2), MAX_BATCH)
        if fits(guess):
            lo = guess
        else:
            hi = guess
    step = 1
    while hi == MAX_BATCH + 1 and lo < MAX_BATCH:  # gallop up to a batch that does not fit
        probe = min(lo + step, MAX_BATCH)
        if fits(probe):
            lo = probe
            step *= 2
        else:
            hi = probe
    while hi - lo > 1:  # then halve the gap
        middle = (lo + hi) // 2
        if fits(middle):
            lo = middle
        else:
            hi = middle
    return lo


#: The largest batch :func:`largest_batch` tries.
MAX_BATCH = 2**16


def plan_table(
    plans: list[Any],
    gpu_memory: int | None = None,
    margin: float = 0.1,
    host_memory: int | None = None,
    largest: dict[str, int] | None = None,
) -> str:
    """One line per strategy, its fullest rank, and the recommendation when a GPU size is given.

    The columns up to ``total`` are what the rank holds on the GPU and add up to it; ``peak``
    is the most the step holds at once there, what must fit; ``host`` what offload keeps in
    host memory; ``payload`` and ``wire`` the communication per optimizer step. The
    recommendation (``recommend``) is the strategy whose peak fits
    (within ``gpu_memory`` less the margin) on the best-maintained engine (FSDP2 before
    FSDP1, both before FairScale), with the fewest bytes on the wire, then the least memory;
    under it, the fine-tuning recipe of the repository's ``examples/recipes`` that trains
    that way.

    Examples:
        >>> from fsdp_guide.memory import plan
        >>> from fsdp_guide.models import MLP
        >>> plans = [plan(MLP(), batch_size=8, seq_len=1, world_size=2, strategy=s)
        ...          for s in ("ddp", "fsdp", "fsdp2")]
        >>> print(plan_table(plans, gpu_memory=2_600_000))  # doctest: +NORMALIZE_WHITESPACE
        142,088 parameters on 2 ranks, fp32 precision; bytes per GPU on the fullest rank
        strategy  params   grads    optimizer  master   buckets  activations  transient ...
        ddp       0.57 MB  0.57 MB  1.14 MB    0.00 MB  0.00 MB  26.11 KB     0.57 MB ...
        fsdp      0.28 MB  0.28 MB  0.57 MB    0.00 MB  0.00 MB  26.11 KB     1.14 MB ...
        fsdp2     0.28 MB  0.28 MB  0.57 MB    0.00 MB  0.00 MB  26.11 KB     1.14 MB ...
        recommended: fsdp2 (its step's peak fits 2.60 MB with 10% margin; maintained
        engines first, then the fewest bytes on the wire)
        recipe: examples/recipes/fsdp2_finetune.py
    """
    from fsdp_guide.cli._recipe import recipe_for
    from fsdp_guide.compare import text_table
    from fsdp_guide.memory import format_bytes, recommend

    biggest = max(max(p.step_peak, p.total, p.host().total) for p in plans)
    unit = "GB" if biggest >= 1e8 else "MB" if biggest >= 1e5 else "KB"
    header = ["strategy", "params", "grads", "optimizer", "master", "buckets"]
    header += ["activations", "transient", "total", "peak", "host", "payload", "wire"]
    if gpu_memory is not None:
        header.append("fits")
    if largest:
        header.append("max batch")
    rows = [header]
    for p in plans:
        device = p.device()
        values = [device.params, device.grads, device.optimizer, device.master, device.buckets]
        values += [p.activations, p.transient, p.total, p.step_peak, p.host().total]
        values += [p.communication.payload_bytes, p.communication.wire_bytes()]
        cells = [p.strategy, *(readable(v, unit) for v in values)]
        if gpu_memory is not None:
            cells.append("yes" if p.fits(gpu_memory, margin, host_memory=host_memory) else "no")
        if largest:
            cells.append(str(largest.get(p.strategy, "")))
        rows.append(cells)
    first = plans[0]
    title = (
        f"{first.num_params:,} parameters on {first.world_size} ranks, {first.precision} "
        "precision; bytes per GPU on the fullest rank"
    )
    out = [title, text_table(rows)]
    if gpu_memory is not None:
        best = recommend(plans, gpu_memory, margin, host_memory)
        size = format_bytes(gpu_memory).replace(".00", "")
        if best is not None:
            out.append(
                f"recommended: {best.strategy} (its step's peak fits {size} with {margin:.0%} "
                "margin; maintained engines first, then the fewest bytes on the wire)"
            )
            out.append(f"recipe: {recipe_for(best.strategy)}")
        else:
            out.append(f"recommended: none fits {size} with {margin:.0%} margin; add GPUs")
    return "\n".join(out)
