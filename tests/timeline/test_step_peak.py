"""The planner's peak of a step against the peak torch's profiler measures, at 2 ranks."""

from __future__ import annotations

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
]


@pytest.fixture(scope="module")
def measured() -> list[tuple[int, str]]:
    """Each run's peak and its phase, from the attempt of either rank that lost no release."""
    ranks: list[list[list[Attempt]]] = launch(
        measure_peaks, world_size=2, args=(RUNS, BATCH), timeout=900
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


def test_unknown_settings_are_named() -> None:
    from fsdp_guide.errors import PlanError

    with pytest.raises(
        PlanError, match="no setting \\['reshard'\\]; its settings: .*reshard_after"
    ):
        _planned("fsdp2", {"reshard": False})
    with pytest.raises(PlanError, match="backward_prefetch must be"):
        _planned("fsdp", {"backward_prefetch": "SOON"})
