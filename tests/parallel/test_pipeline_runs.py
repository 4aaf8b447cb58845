"""Pipeline parallelism on real gloo ranks against the planner: each rank's state, its peak
of activations, its messages and collectives, the order of its actions, and the losses of
one process. Six launches, shared by every assertion (GPipe and 1F1B at 2 and 4 stages,
1F1B with FSDP2 on a 2 x 2 mesh, ZBV zero bubble)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsdp_guide.launcher import launch
from fsdp_guide.memory import Plan, plan
from fsdp_guide.parallel import (
    ParallelConfig,
    ParallelTransformer,
    reference_losses,
    train_pipeline,
)

CONFIG = ParallelConfig(dim=32, n_heads=4, n_layers=2, seq_len=8, hidden=64)
BATCH = 8

#: id -> (schedule, pipeline ranks, data-parallel ranks, micro-batches)
CASES = {
    "gpipe-2": ("GPipe", 2, 1, 4),
    "1f1b-2": ("1F1B", 2, 1, 4),
    "gpipe-4": ("GPipe", 4, 1, 4),
    "1f1b-4": ("1F1B", 4, 1, 4),
    "1f1b-2x2-fsdp2": ("1F1B", 2, 2, 2),
    "zbv-2": ("ZBVZeroBubble", 2, 1, 4),
}

Runs = list[dict[str, Any]]


def _tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return ids, ids.clone()


def _plan(case: str) -> Plan:
    schedule, pp, dp, m = CASES[case]
    return plan(
        lambda: ParallelTransformer(CONFIG),
        batch_size=BATCH // dp,
        seq_len=CONFIG.seq_len,
        world_size=pp * dp,
        strategy="fsdp2",
        pipeline_parallel=pp,
        microbatches=m,
        schedule=schedule,
        batch=_tokens,
    )


@pytest.fixture(scope="module")
def launched() -> Callable[[str], Runs]:
    done: dict[str, Runs] = {}

    def get(case: str) -> Runs:
        if case not in done:
            schedule, pp, dp, m = CASES[case]
            kwargs = {"schedule": schedule, "microbatches": m, "dp": dp, "config": CONFIG}
            # Forked ranks: a spawned rank that imported torch.distributed.pipelining takes
            # seconds to exit, which the launcher reports and stops.
            done[case] = launch(
                train_pipeline,
                world_size=pp * dp,
                kwargs={**kwargs, "batch_size": BATCH},
                start_method="fork",
            )
        return done[case]

    return get


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_each_rank_holds_the_planned_state_and_activations(
    launched: Callable[[str], Runs], case: str
) -> None:
    planned = _plan(case)
    assert planned.pipeline is not None
    for rank, run in enumerate(launched(case)):
        assert run["state"] == planned.ranks[rank]
        assert run["activations"] == planned.pipeline.plan_of(rank).activations
        assert run["stages"] == planned.pipeline.stages_of(rank)


def test_each_rank_sends_the_planned_bytes(launched: Callable[[str], Runs], case: str) -> None:
    planned = _plan(case)
    assert planned.pipeline is not None
    for rank, run in enumerate(launched(case)):
        payload = planned.pipeline.plan_of(rank).communication.payload
        assert run["collectives"] == {kind: 4 * n for kind, n in payload.items()}
        assert run["collectives"]["send"] > 0


def test_each_rank_runs_the_schedules_actions_in_order(
    launched: Callable[[str], Runs], case: str
) -> None:
    planned = _plan(case)
    assert planned.pipeline is not None
    for run in launched(case):
        ran = [action for action, _, _ in run["timeline"]]
        assert ran == [str(a) for a in planned.pipeline.schedule.actions[run["pp_rank"]]]


def test_the_pipeline_trains_like_one_process(launched: Callable[[str], Runs], case: str) -> None:
    """Each data-parallel group's last stage reports the mean loss of its micro-batches; the
    groups' mean is the loss of the whole batch. Sums over micro-batches and over the batch
    add in another order, so they agree to float32 rounding (rtol 1e-5)."""
    groups = [run["losses"] for run in launched(case) if run["losses"]]
    assert len(groups) == CASES[case][2]
    means = [sum(step) / len(step) for step in zip(*groups, strict=True)]
    single = reference_losses(steps=len(means), batch_size=BATCH, config=CONFIG)
    torch.testing.assert_close(torch.tensor(means), torch.tensor(single), rtol=1e-5, atol=0)


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p_minus_s(
    launched: Callable[[str], Runs],
) -> None:
    for p in (2, 4):
        gpipe, one = _plan(f"gpipe-{p}").pipeline, _plan(f"1f1b-{p}").pipeline
        assert gpipe is not None and one is not None
        assert list(gpipe.peak_in_flight) == [{s: 4} for s in range(p)]
        assert list(one.peak_in_flight) == [{s: min(4, p - s)} for s in range(p)]
        # Measured: stage 1 (a block) holds fewer micro-batches under 1F1B than under GPipe.
        g, o = launched(f"gpipe-{p}"), launched(f"1f1b-{p}")
        assert g[1]["activations"] > o[1]["activations"]
