"""The planner's peak of a step against the peak torch's profiler measures, at 2 ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from step_peak_runs import Attempt, Run, best_attempt, measure_peaks, plan_run

from fsdp_guide.engines import DDP, FSDP1, FSDP2, StepSizes, engine_for
from fsdp_guide.launcher import launch

BATCH = 8
# (catalog strategy, the adapter's settings): each is built as a lesson builds it.
RUNS: list[Run] = [
    ("ddp", {}),
    ("zero1", {}),
    ("fsdp", {}),
    ("fsdp", {"backward_prefetch": None}),
    ("fsdp2", {}),
    ("fsdp2", {"reshard_after_forward": False}),
    ("ddp", {"gradient_as_bucket_view": False}),  # torch's default: buckets beside the grads
    ("zero1", {"gradient_as_bucket_view": False}),
    ("deepspeed_zero3", {}),
    ("fsdp2", {"backward_prefetch": 2}),
    ("fsdp2", {"forward_prefetch": 2}),
]


@pytest.fixture(scope="module")
def measured() -> list[tuple[int, str]]:
    """Each run's peak and its phase, from the attempt of either rank that lost no release."""
    ranks: list[list[list[Attempt]]] = launch(
        measure_peaks, world_size=2, args=(RUNS, BATCH), start_method="fork", timeout=900
    )
    best = [best_attempt([rank[i] for rank in ranks]) for i in range(len(RUNS))]
    return [(peak, phase) for _, peak, phase in best]


def _planned(strategy: str, settings: dict[str, Any]) -> Any:
    return plan_run(strategy, settings, batch=BATCH, world_size=2)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{s}{o}" for s, o in RUNS])
def test_the_planned_peak_of_a_step_is_the_measured_one(
    measured: list[tuple[int, str]], index: int
) -> None:
    peak, phase = measured[index]
    planned = _planned(*RUNS[index])
    assert abs(peak / planned.step_peak - 1) < 0.05, (RUNS[index], peak, planned.step_peak)
    assert phase == planned.step_peak_phase, (RUNS[index], peak, phase)


def test_the_knobs_move_the_peak_as_measured(measured: list[tuple[int, str]]) -> None:
    peaks = dict(zip([str(r) for r in RUNS], (p for p, _ in measured), strict=True))
    # One block fewer gathered without backward prefetch; every block kept without resharding.
    assert peaks["('fsdp', {'backward_prefetch': None})"] < peaks["('fsdp', {})"]
    assert peaks["('fsdp2', {'reshard_after_forward': False})"] > peaks["('fsdp2', {})"]
    planned = [_planned(*run).step_peak for run in RUNS]
    assert planned[3] < planned[2] and planned[5] > planned[4]


def test_fsdp2_explicit_prefetch_moves_the_peak_as_measured(
    measured: list[tuple[int, str]],
) -> None:
    peaks = {str(run): peak for run, (peak, _) in zip(RUNS, measured, strict=True)}
    default = peaks["('fsdp2', {})"]
    # Two blocks gathered ahead of the running one in backward: one block more than FSDP2's
    # own prefetch, early in backward.
    added = peaks["('fsdp2', {'backward_prefetch': 2})"] - default
    planned_added = (
        _planned("fsdp2", {"backward_prefetch": 2}).step_peak - _planned("fsdp2", {}).step_peak
    )
    assert planned_added > 0 and abs(added - planned_added) < 0.05 * planned_added, (
        added,
        planned_added,
    )
    # Two blocks gathered ahead in forward leave the peak where it was: they are held while
    # the later blocks' activations (more bytes than a block's parameters at this batch)
    # are not saved yet, so backward still holds more.
    forward = peaks["('fsdp2', {'forward_prefetch': 2})"]
    assert abs(forward - default) < planned_added / 2, (forward, default)
    assert _planned("fsdp2", {"forward_prefetch": 2}).step_peak == _planned("fsdp2", {}).step_peak


SIZES = StepSizes(
    params=1000, grads=1000, largest_unit=200, largest_unit_grads=200, root_unit=100, activations=50
)


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (FSDP2(), 50 + 100 + 400 + 200),
        (FSDP2(reshard_after_forward=False), 50 + 1000 + 200),
        # The other blocks' thirds: the two gathered blocks' thirds are freed.
        (FSDP2(reshard_after_forward=3), 50 + 100 + (1000 - 100 - 400) // 3 + 400 + 200),
        (FSDP1(), 50 + 100 + 400 + 200),
        (FSDP1(backward_prefetch="BACKWARD_POST"), 50 + 100 + 200 + 200),
        (FSDP1(backward_prefetch=None, forward_prefetch=True), 50 + 100 + 400 + 200),
        (FSDP1(sharding_strategy="SHARD_GRAD_OP"), 50 + 1000 + 200),
        (FSDP1(sharding_strategy="NO_SHARD"), 50 + 1000),
        (engine_for("ddp"), 50),  # the gradients land in the buckets kept between steps
        (DDP(gradient_as_bucket_view=False), 1000),  # every gradient beside the buckets
        (engine_for("deepspeed_zero3"), 50 + 1000),
    ],
    ids=str,
)
def test_what_each_engine_holds_at_the_peak(engine: Any, expected: int) -> None:
    assert engine.step_peak(SIZES, 2).bytes == expected


# What the later moment of backward adds to the gathered blocks: the activations but the
# last block's (of 4), an all-gather buffer, the last block's gradients in the
# reduce-scatter's input and half of them (2 ranks) in its output.
LATER = 200 + 200 + 200 // 2


@pytest.mark.parametrize(
    ("engine", "activations", "expected"),
    [
        # A block's activations (50 / 4) under its parameters: the peak is the later moment,
        # with the running block and, nearest first, as many before it as asked (at least
        # FSDP2's own one, at most the 3 blocks there are before the last).
        (FSDP2(backward_prefetch=1), 50, (50 - 12 + 100 + 400 + LATER, "backward")),
        (FSDP2(backward_prefetch=2), 50, (50 - 12 + 100 + 600 + LATER, "backward")),
        (FSDP2(backward_prefetch=9), 50, (50 - 12 + 100 + 800 + LATER, "backward")),
        (
            FSDP2(reshard_after_forward=2, backward_prefetch=2),
            50,
            (50 - 12 + 100 + (1000 - 100 - 600) // 2 + 600 + LATER, "backward"),
        ),
        # A block's activations (2000 / 4) over its parameters and buffers: the last
        # block's backward, with every activation and one block's gradients.
        (FSDP2(), 2000, (2000 + 100 + 400 + 200, "backward")),
        (FSDP2(backward_prefetch=2), 2000, (2000 + 100 + 600 + 200, "backward")),
        # Forward, at block 0 of 4: its activations, the root, block 0 and its buffer,
        # blocks 1-3's buffers; above backward only when activations are few.
        (FSDP2(forward_prefetch=3), 50, (12 + 100 + 1000, "forward")),
        (FSDP2(forward_prefetch=2), 2000, (2000 + 100 + 400 + 200, "backward")),
        (FSDP2(forward_prefetch=2, reshard_after_forward=False), 50, (50 + 1000 + 200, "forward")),
    ],
    ids=str,
)
def test_what_fsdp2_holds_at_the_peak_with_explicit_prefetch(
    engine: FSDP2, activations: int, expected: tuple[int, str]
) -> None:
    sizes = replace(SIZES, activations=activations, blocks=4)
    peak = engine.step_peak(sizes, 2)
    assert (peak.bytes, peak.phase) == expected


def test_unknown_settings_are_named() -> None:
    from fsdp_guide.errors import PlanError

    with pytest.raises(
        PlanError, match="no setting \\['reshard'\\]; its settings: .*reshard_after"
    ):
        _planned("fsdp2", {"reshard": False})
    with pytest.raises(PlanError, match="backward_prefetch must be"):
        _planned("fsdp", {"backward_prefetch": "SOON"})


@pytest.mark.parametrize("bad", [-1, True, 1.5, None], ids=repr)
@pytest.mark.parametrize("name", ["forward_prefetch", "backward_prefetch"])
def test_a_bad_fsdp2_prefetch_count_is_named_with_the_fix(name: str, bad: Any) -> None:
    from fsdp_guide.errors import PlanError

    with pytest.raises(PlanError, match=rf"FSDP2's {name} is how many blocks .* give an int >= 0"):
        _planned("fsdp2", {name: bad})
