"""The planner's peak of a step against the peak torch's profiler measures, at 2 ranks."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_guide.engines import FSDP1, FSDP2, StepSizes, engine_for
from fsdp_guide.launcher import launch
from fsdp_guide.memory import measure_model_state, plan
from fsdp_guide.models import Block, build_model, loss_fn, shard_batch, synthetic_batch
from fsdp_guide.timeline import record_step
from fsdp_guide.wrap import LayerPolicy, shard

BATCH = 8
# (catalog strategy, the adapter's settings): each is built as a lesson builds it.
RUNS: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {}),
    ("zero1", {}),
    ("fsdp", {}),
    ("fsdp", {"backward_prefetch": None}),
    ("fsdp2", {}),
    ("fsdp2", {"reshard_after_forward": False}),
]


def _build(strategy: str, settings: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    model = build_model("transformer")
    if strategy in ("ddp", "zero1"):
        model = DDP(model)
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
            )
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    options = dict(settings)
    if "backward_prefetch" in options:  # the adapter's name, FSDP1's enum
        from torch.distributed.fsdp import BackwardPrefetch

        name = options["backward_prefetch"]
        options["backward_prefetch"] = BackwardPrefetch[name] if name else None
    engine = "fsdp1" if strategy == "fsdp" else strategy
    model = shard(model, engine=engine, policy=LayerPolicy(Block), **options)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _peaks(rank: int, world_size: int) -> list[tuple[int, str]]:
    warnings.filterwarnings("ignore")
    out = []
    for strategy, settings in RUNS:
        model, optimizer = _build(strategy, settings)
        batch = shard_batch(synthetic_batch("transformer", BATCH), rank, world_size)
        for _ in range(1):  # the first step creates Adam's state
            loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
        state = measure_model_state(model, optimizer)
        timeline = record_step(
            lambda m=model, b=batch: loss_fn(m, b),
            lambda loss: loss.backward(),
            lambda o=optimizer: (o.step(), o.zero_grad()),
            state_before={
                "params": state.params,
                "grads": state.grads,
                "optimizer": state.optimizer,
            },
        )
        out.append((timeline.peak, timeline.phase_at(timeline.times_us[timeline.peak_index])))
    return out


@pytest.fixture(scope="module")
def measured() -> list[tuple[int, str]]:
    return launch(_peaks, world_size=2)[0]


def _planned(strategy: str, settings: dict[str, Any]) -> Any:
    return plan(
        build_model("transformer"),
        batch_size=BATCH // 2,
        seq_len=32,
        world_size=2,
        strategy=strategy,
        settings=settings,
    )


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
        (FSDP2(reshard_after_forward=3), 50 + 100 + 900 // 3 + 400 + 200),
        (FSDP1(), 50 + 100 + 400 + 200),
        (FSDP1(backward_prefetch="BACKWARD_POST"), 50 + 100 + 200 + 200),
        (FSDP1(backward_prefetch=None, forward_prefetch=True), 50 + 100 + 400 + 200),
        (FSDP1(sharding_strategy="SHARD_GRAD_OP"), 50 + 1000 + 200),
        (FSDP1(sharding_strategy="NO_SHARD"), 50 + 1000),
        (engine_for("ddp"), 50 + 1000),
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
