"""plan_ranks: a rank per GPU under NCCL with two GPUs or more, else CPU ranks under gloo."""

from __future__ import annotations

import pytest
import torch

from fsdp_guide.launcher import RankPlan, _plan, plan_ranks
from fsdp_guide.models import shard_batch, synthetic_batch


@pytest.mark.parametrize(
    ("gpus", "cpu_world_size", "expected"),
    [
        (0, 2, RankPlan(world_size=2, backend="gloo", gpus=0)),
        (0, 4, RankPlan(world_size=4, backend="gloo", gpus=0)),
        (1, 2, RankPlan(world_size=2, backend="gloo", gpus=1)),  # one GPU cannot hold 2 NCCL ranks
        (2, 2, RankPlan(world_size=2, backend="nccl", gpus=2)),
        (3, 2, RankPlan(world_size=2, backend="nccl", gpus=3)),  # batches of 8 split by 2, not 3
        (4, 2, RankPlan(world_size=4, backend="nccl", gpus=4)),
        (6, 2, RankPlan(world_size=4, backend="nccl", gpus=6)),
        (8, 4, RankPlan(world_size=8, backend="nccl", gpus=8)),
    ],
)
def test_plan_follows_the_gpu_count(
    monkeypatch: pytest.MonkeyPatch, gpus: int, cpu_world_size: int, expected: RankPlan
) -> None:
    monkeypatch.setattr(_plan, "_gpu_count", lambda: gpus)
    plan = plan_ranks(cpu_world_size)
    assert plan == expected
    assert plan.accelerator == ("gpu" if expected.backend == "nccl" else "cpu")
    # The lessons print the plan: it must say which backend and why.
    assert ("NCCL" if expected.backend == "nccl" else "gloo") in str(plan)
    assert str(gpus) in str(plan) or (gpus == 0 and "no GPU" in str(plan))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_plan_rejects_a_bad_cpu_world_size(bad: object) -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        plan_ranks(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", [None, "cpu", torch.device("meta")])
def test_shard_batch_puts_inputs_and_targets_on_the_device(
    device: torch.device | str | None,
) -> None:
    batch = synthetic_batch("transformer", batch_size=8)
    x, y = shard_batch(batch, rank=1, world_size=2, device=device)
    expected = torch.device("cpu") if device is None else torch.device(device)
    assert (x.device, y.device) == (expected, expected)
    assert x.shape[0] == y.shape[0] == 4
    if device != torch.device("meta"):
        assert torch.equal(x, batch[0][4:]) and torch.equal(y, batch[1][4:])


@pytest.mark.parametrize(
    ("value", "gpus", "expected"),
    [
        ("nccl:1", 1, RankPlan(world_size=1, backend="nccl", gpus=1)),
        ("gloo:4", 1, RankPlan(world_size=4, backend="gloo", gpus=1)),
        ("gloo:1", 0, RankPlan(world_size=1, backend="gloo", gpus=0)),
        (" nccl:2 ", 8, RankPlan(world_size=2, backend="nccl", gpus=8)),
    ],
)
def test_the_environment_overrides_the_plan(
    monkeypatch: pytest.MonkeyPatch, value: str, gpus: int, expected: RankPlan
) -> None:
    monkeypatch.setattr(_plan, "_gpu_count", lambda: gpus)
    monkeypatch.setenv("FSDP_GUIDE_RANKS", value)
    assert plan_ranks() == expected


@pytest.mark.parametrize(
    ("value", "gpus", "message"),
    [
        ("nccl", 1, "write BACKEND:N"),
        ("mpi:2", 1, "write BACKEND:N"),
        ("gloo:0", 0, "write BACKEND:N"),
        ("gloo:two", 0, "write BACKEND:N"),
        ("nccl:2", 1, "asks for 2 NCCL ranks but 1 GPUs are visible"),
        ("nccl:1", 0, "asks for 1 NCCL ranks but 0 GPUs"),
    ],
)
def test_a_bad_override_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, value: str, gpus: int, message: str
) -> None:
    monkeypatch.setattr(_plan, "_gpu_count", lambda: gpus)
    monkeypatch.setenv("FSDP_GUIDE_RANKS", value)
    with pytest.raises(ValueError, match=message):
        plan_ranks()


def test_one_nccl_rank_reads_well() -> None:
    assert (
        str(RankPlan(world_size=1, backend="nccl", gpus=1))
        == "1 rank on one GPU, NCCL (1 GPU visible)"
    )
