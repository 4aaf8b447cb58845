"""Train the demo model under each strategy on N ranks and measure what every rank holds.

:func:`train_and_measure` is the training function that runs on each rank;
:func:`run_comparison` launches it once per strategy and pairs each rank's measured
model state with the ZeRO prediction. This is what ``python -m fsdp_guide compare`` does.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from fsdp_guide.catalog import check_strategies
from fsdp_guide.comm import CommStats, count_collectives, predict_communication
from fsdp_guide.compare._report import ComparisonRow
from fsdp_guide.engines import engine_for, with_wrap, wrap_for_strategy
from fsdp_guide.launcher import check_world_size, launch, visible_gpus
from fsdp_guide.memory import (
    ModelState,
    PeakMemory,
    measure_model_state,
    peak_memory,
    predict_model_state,
)
from fsdp_guide.models import (
    ModelName,
    build_model,
    check_model_name,
    count_params,
    loss_fn,
    shard_batch,
    synthetic_batch,
)


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured while training under one strategy.

    Attributes:
        strategy: Strategy name.
        rank: The rank.
        num_params: Parameters of the unwrapped model.
        state: Model state held after the last ``optimizer.step()``.
        step_time_s: Mean wall time of a training step (the first step excluded when
            there are several: it allocates the optimizer state).
        loss: Loss of the last step on this rank's slice of the batch.
        peak: Peak memory of the rank (CUDA peak allocated, or process peak RSS on CPU).
        comm: Collectives this rank issued in the last step (forward, backward and
            ``optimizer.step()``); ``None`` when not counted.
        root_unit_params: Parameters of the root unit of a fully sharded model (gathered
            once per step, not twice), ``0`` for the others.
        param_numels: The size of each parameter tensor of the unwrapped model (DeepSpeed's
            ZeRO-3 pads each one).
    """

    strategy: str
    rank: int
    num_params: int
    state: ModelState
    step_time_s: float
    loss: float
    peak: PeakMemory
    comm: CommStats | None = None
    root_unit_params: int = 0
    param_numels: tuple[int, ...] = ()


def train_and_measure(
    rank: int,
    world_size: int,
    strategy: str,
    model_name: ModelName = "transformer",
    steps: int = 3,
    batch_size: int = 8,
    count_comm: bool = True,
    wrap: str = "blocks",
) -> RankMeasurement:
    """Train the demo model for ``steps`` steps under ``strategy``; measure this rank.

    Runs on a launched rank (``launch(train_and_measure, world_size, args=(...))``).
    Every rank builds the same seeded model and takes its slice of the same global batch,
    so the losses of all strategies can be compared. The state is measured after the last
    ``optimizer.step()``, before ``zero_grad()``. The strategy's engine takes each step
    (:meth:`~fsdp_guide.engines.Engine.train_step`: a DeepSpeed engine steps through
    ``engine.backward`` and ``engine.step``).

    Args:
        rank: This rank.
        world_size: Number of ranks.
        strategy: A name from :data:`~fsdp_guide.catalog.STRATEGIES`.
        model_name: ``"transformer"`` or ``"mlp"``.
        steps: Training steps (at least 1).
        batch_size: Global batch size; must divide by ``world_size``.
        count_comm: Count the collectives of the last step
            (:func:`~fsdp_guide.comm.count_collectives`).
        wrap: FSDP's units: ``"blocks"`` (a unit per transformer block) or ``"root"``.

    Returns:
        This rank's :class:`RankMeasurement`.

    Examples:
        One rank, the MLP (142,088 parameters), plain DDP: 16 bytes per parameter plus
        Adam's 4-byte step counter for each of its 8 tensors.

        >>> (result,) = launch(
        ...     train_and_measure, 1, args=("ddp", "mlp", 1), backend="gloo", start_method="fork"
        ... )
        >>> result.state.total == 16 * 142_088 + 8 * 4
        True
        >>> result.comm.kinds["all_reduce"].elements  # one rank all-reduces too
        142088
    """
    torch.manual_seed(0)
    engine = with_wrap(engine_for(strategy), wrap)
    model = build_model(model_name)
    num_params = count_params(model)
    numels = tuple(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        # The wrappers warn about CPU devices and deprecations; the lesson is the numbers.
        warnings.simplefilter("ignore")
        module, optimizer = wrap_for_strategy(model, strategy, world_size, wrap=wrap)
        device = next(module.parameters()).device
        times = []
        comm = None
        for step in range(steps):
            batch = shard_batch(synthetic_batch(model_name, batch_size, step), rank, world_size)
            x, y = (t.to(device) for t in batch)
            # The last step only: construction and the first step's lazy setup are not
            # what a step costs.
            with count_collectives() if count_comm and step == steps - 1 else nullcontext() as c:
                start = time.perf_counter()
                loss = loss_fn(module, (x, y))
                engine.train_step(module, optimizer, loss)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            if c is not None:
                comm = c.stats
            if step == steps - 1:
                state = measure_model_state(module, optimizer)
            engine.zero_grad(module, optimizer)
    timed = times[1:] or times
    return RankMeasurement(
        strategy=strategy,
        rank=rank,
        num_params=num_params,
        state=state,
        step_time_s=sum(timed) / len(timed),
        loss=loss.item(),
        peak=peak_memory(device if device.type == "cuda" else "cpu"),
        comm=comm,
        root_unit_params=engine.root_unit_params(module),
        param_numels=numels,
    )


def _print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_comparison(
    strategies: Sequence[str],
    world_size: int = 2,
    model_name: ModelName = "transformer",
    steps: int = 3,
    batch_size: int = 8,
    progress: Callable[[str], None] | None = _print_progress,
    timeout: float = 300.0,
    comm: bool = True,
    wrap: str = "blocks",
) -> list[ComparisonRow]:
    """Train under each strategy on launched ranks; pair measurements with predictions.

    Args:
        strategies: Names from :data:`~fsdp_guide.catalog.STRATEGIES`.
        world_size: Ranks per run.
        model_name: ``"transformer"`` or ``"mlp"``.
        steps: Training steps per strategy.
        batch_size: Global batch size; must divide by ``world_size``.
        progress: Called with one line before and after each run (``None``: silent).
        timeout: Seconds each run may take.
        comm: Count each rank's collectives in the last step and set them next to
            :func:`~fsdp_guide.comm.predict_communication`.
        wrap: How the fully sharded strategies cut the model into units: ``"blocks"`` (a
            unit per transformer block, as the planner assumes by default) or ``"root"``
            (the whole model one unit).

    Returns:
        One :class:`~fsdp_guide.compare.ComparisonRow` per strategy and rank.

    Raises:
        ValueError: Bad strategy, model, world size, steps or batch size, before any
            process starts.

    Examples:
        >>> run_comparison(["ddp"], world_size=3, batch_size=8)
        Traceback (most recent call last):
        ...
        ValueError: batch size 8 does not divide by world_size=3; pass a multiple of 3
    """
    specs = check_strategies(list(strategies))
    check_model_name(model_name)
    check_world_size(world_size)
    with_wrap(engine_for("fsdp2"), wrap)  # refuses an unknown wrap before any process starts
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(
            f"batch size {batch_size} does not divide by world_size={world_size}; "
            f"pass a multiple of {world_size}"
        )
    gpus = visible_gpus()
    for spec in specs:
        if spec.needs_cuda and gpus < world_size:
            raise ValueError(
                f"strategy {spec.name!r} needs one GPU per rank: world_size={world_size} but "
                f"{gpus} GPU(s) visible; lower --world-size or leave it out"
            )
    # Fork starts ranks in a fraction of spawn's time, but with a GPU visible a forked rank
    # fails once this process has run a backward pass or initialised CUDA.
    forks = sys.platform == "linux" and gpus == 0
    method: Literal["fork", "spawn"] = "fork" if forks else "spawn"
    rows: list[ComparisonRow] = []
    for index, spec in enumerate(specs, start=1):
        if progress:
            progress(
                f"[{index}/{len(specs)}] {spec.name}: {spec.summary}, {world_size} rank(s) ..."
            )
        start = time.perf_counter()
        results: list[RankMeasurement] = launch(
            train_and_measure,
            world_size,
            args=(spec.name, model_name, steps, batch_size, comm, wrap),
            backend="nccl" if spec.needs_cuda else "gloo",
            timeout=timeout,
            start_method=method,
        )
        for result in results:
            rows.append(
                ComparisonRow(
                    strategy=spec.name,
                    rank=result.rank,
                    world_size=world_size,
                    zero_stage=spec.zero_stage,
                    measured=result.state,
                    predicted=predict_model_state(
                        spec, result.num_params, world_size, result.param_numels
                    ),
                    step_time_s=result.step_time_s,
                    loss=result.loss,
                    peak_bytes=result.peak.bytes,
                    peak_kind=result.peak.kind,
                    comm_measured=result.comm,
                    comm_predicted=predict_communication(
                        spec.name,
                        result.num_params,
                        world_size,
                        root_unit_params=result.root_unit_params,
                    )
                    if comm
                    else None,
                )
            )
        if progress:
            progress(
                f"[{index}/{len(specs)}] {spec.name}: done in {time.perf_counter() - start:.1f} s"
            )
    return rows
