"""The planner's peak of a step against the peak torch's profiler measures, at 4 ranks.

One launch of 4 gloo ranks measures each run's second step. The typical rank's peak (the
lower median of the four) is held to the planner's figure for that world size, with the
tolerance and phase check of the 2-rank test. Now and then one rank, a different one from
run to run, peaks 465,024 B higher in backward (seen with FSDP1 and FSDP2), so rank 0 alone
would make the test depend on the ranks' timing. ``reshard_after_forward=2`` is only
measurable here: torch takes an int that divides the shard group and is neither 1 nor the
group's size.
"""

from __future__ import annotations

from statistics import median_low

import pytest
from step_peak_runs import Run, measure_peaks, plan_run

from fsdp_guide.launcher import launch

BATCH = 8
WORLD = 4
RUNS: list[Run] = [
    ("fsdp2", {}),
    ("fsdp", {}),
    ("fsdp2", {"reshard_after_forward": 2}),
    ("ddp", {}),
]
# Measured on torch 2.13 CPU, and not yet planned within 5% (strict: a fix shows up here).
UNDER_PLANNED = {
    0: "FSDP2: 7,983,452 B measured in backward, 7,486,168 planned (+6.6%)",
    2: "FSDP2 int 2: 8,776,540 B measured in backward, 8,279,256 planned (+6.0%)",
    3: "DDP: 17,786,092 B measured in the optimizer step, 16,046,040 planned in backward",
}


@pytest.fixture(scope="module")
def measured() -> list[list[tuple[int, str]]]:
    return launch(measure_peaks, world_size=WORLD, args=(RUNS, BATCH))


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=UNDER_PLANNED[i]))
        if i in UNDER_PLANNED
        else i
        for i in range(len(RUNS))
    ],
    ids=[f"{s}{o}" for s, o in RUNS],
)
def test_the_planned_peak_of_a_step_is_the_measured_one_at_4_ranks(
    measured: list[list[tuple[int, str]]], index: int
) -> None:
    planned = plan_run(*RUNS[index], batch=BATCH, world_size=WORLD)
    per_rank = [runs[index] for runs in measured]
    peak, phase = median_low(per_rank)
    assert abs(peak / planned.step_peak - 1) < 0.05, (RUNS[index], per_rank, planned.step_peak)
    assert phase == planned.step_peak_phase, (RUNS[index], per_rank, planned.step_peak_phase)


def _least(measured: list[list[tuple[int, str]]], index: int) -> int:
    # A difference of two runs takes each run's lowest rank: the timing-dependent extras
    # (+465,024 or +793,088 B on one or two ranks at once) can land on two of the four
    # ranks in one run and on none in the other, and a median then takes one in.
    return min(runs[index][0] for runs in measured)


def test_what_resharding_to_pairs_adds_is_planned(measured: list[list[tuple[int, str]]]) -> None:
    # Two of the four blocks keep their half from forward to the peak (the two gathered
    # there were gathered from theirs): the difference to the default is planned exactly.
    default, pairs = (plan_run(*RUNS[i], batch=BATCH, world_size=WORLD) for i in (0, 2))
    added = _least(measured, 2) - _least(measured, 0)
    planned_added = pairs.step_peak - default.step_peak
    assert added > 0 and planned_added > 0, (added, planned_added)
    assert abs(added - planned_added) < 0.05 * pairs.step_peak, (added, planned_added)
