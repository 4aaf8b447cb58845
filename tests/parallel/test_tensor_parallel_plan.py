"""Tensor parallelism on a (dp, tp) mesh, with and without sequence parallelism: the
planner's figures against real 4-rank runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import plan
from fsdp_guide.models import MLP
from fsdp_guide.parallel import ParallelConfig, ParallelTransformer, reference_losses, train_2d

CONFIG = ParallelConfig(dim=32, n_heads=4, n_layers=2, seq_len=8, hidden=64)
BATCH = 4


def _tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return ids, ids.clone()


def _plan(world_size: int, tp: int, **kwargs: Any) -> Any:
    return plan(
        lambda: ParallelTransformer(CONFIG),
        batch_size=BATCH // (world_size // tp),
        seq_len=CONFIG.seq_len,
        world_size=world_size,
        strategy="fsdp2",
        tensor_parallel=tp,
        batch=_tokens,
        **kwargs,
    )


Runs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def launched() -> Callable[[bool], Runs]:
    """The 4-rank run with or without sequence parallelism, each launched once."""
    done: dict[bool, Runs] = {}

    def get(sequence_parallel: bool) -> Runs:
        if sequence_parallel not in done:
            kwargs = {"batch_size": BATCH, "config": CONFIG, "sequence_parallel": sequence_parallel}
            done[sequence_parallel] = launch(
                train_2d, world_size=4, args=(2, 2), kwargs=kwargs, start_method="fork"
            )
        return done[sequence_parallel]

    return get


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "tp+sp"])
def sp(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def runs(launched: Callable[[bool], Runs], sp: bool) -> Runs:
    return launched(sp)


def test_each_rank_holds_the_planned_state(runs: Runs, sp: bool) -> None:
    planned = _plan(4, 2, sequence_parallel=sp)
    assert [r["state"] for r in runs] == list(planned.ranks)
    # TP cuts the blocks: a rank holds more than a quarter (dp=2) but less than a half.
    flat = _plan(4, 1)
    assert flat.state.params < planned.state.params < 2 * flat.state.params


def test_each_collective_sends_the_planned_bytes(runs: Runs, sp: bool) -> None:
    planned = _plan(4, 2, sequence_parallel=sp).communication
    expected = {kind: 4 * n for kind, n in planned.payload.items()}
    assert set(expected) == {"all_gather", "reduce_scatter", "all_reduce"}
    for r in runs:
        assert r["collectives"] == expected
    assert planned.group_sizes["all_reduce"] == 2


def test_activations_are_those_traced_on_the_cut_model(runs: Runs, sp: bool) -> None:
    planned = _plan(4, 2, sequence_parallel=sp).activations
    assert abs(runs[0]["activations"] - planned) <= 0.01 * planned
    assert (
        planned
        < _plan(
            4,
            1,
        ).activations
        * 2
    )  # twice the samples, half of each block


def test_the_2d_run_trains_like_the_unsharded_model(runs: Runs) -> None:
    groups = [r["losses"] for r in runs if r["tp_rank"] == 0]
    means = [sum(step) / len(step) for step in zip(*groups, strict=True)]
    single = reference_losses(steps=len(means), batch_size=BATCH, config=CONFIG)
    torch.testing.assert_close(torch.tensor(means), torch.tensor(single), rtol=1e-5, atol=0)


def test_sequence_parallelism_adds_no_gap_of_its_own(launched: Callable[[bool], Runs]) -> None:
    """What sequence parallelism changes in the activations is planned to the byte: the
    measured-minus-planned gap is the one plain tensor parallelism already has."""
    gaps, measured = [], []
    for sp in (False, True):
        ranks = launched(sp)
        planned = _plan(4, 2, sequence_parallel=sp).activations
        assert len({r["activations"] for r in ranks}) == 1  # the same shapes on every rank
        gaps.append(ranks[0]["activations"] - planned)
        measured.append(ranks[0]["activations"])
    assert gaps[1] == gaps[0]
    assert measured[1] < measured[0]
    # Both runs compute the same numbers: SP moves data between ranks, not arithmetic.
    assert [r["losses"] for r in launched(True)] == [r["losses"] for r in launched(False)]


@pytest.mark.parametrize(("world_size", "tp"), [(4, 2), (4, 4), (8, 2)])
def test_sequence_parallelism_moves_all_reduces_to_scatters_and_gathers(
    world_size: int, tp: int
) -> None:
    plain, sp = _plan(world_size, tp), _plan(world_size, tp, sequence_parallel=True)
    assert sp.ranks == plain.ranks  # no parameter is cut further
    assert sp.activations < plain.activations
    tokens = BATCH // (world_size // tp) * CONFIG.seq_len
    width, blocks = CONFIG.dim, CONFIG.n_layers
    before, after = plain.communication.payload, sp.communication.payload
    # Left to all-reduce: the gradients of the norms' replicated weights (2 per block, 1 final).
    assert after["all_reduce"] == (2 * blocks + 1) * 2 * width
    assert before["all_reduce"] == blocks * 6 * tokens * width  # 2 rowwise + 4 colwise layers
    # Per block, forward reduce-scatters 2 rowwise outputs, backward 2 gathered inputs' grads;
    # the all-gathers mirror them, plus the head's input and the first block's input grad.
    scattered = after["reduce_scatter"] - before["reduce_scatter"]
    gathered = after["all_gather"] - before["all_gather"]
    assert scattered == blocks * 4 * tokens * width
    assert gathered == scattered + 2 * tokens * width


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_parallel": True}, "pass tensor_parallel > 1"),
        ({"sequence_parallel": 1, "tensor_parallel": 2}, "True or False"),
        ({"sequence_parallel": True, "tensor_parallel": 4, "seq_len": 6}, "seq_len=6 is not"),
    ],
)
def test_a_bad_sequence_parallel_request_is_a_plan_error(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"batch_size": 2, "seq_len": 8, "world_size": 4, **kwargs}
    with pytest.raises(PlanError, match=message):
        plan(lambda: ParallelTransformer(CONFIG), strategy="fsdp2", batch=_tokens, **args)


def test_sequence_parallelism_needs_blocks_and_a_head() -> None:
    with pytest.raises(PlanError, match="`blocks`"):
        plan(
            MLP(),
            batch_size=2,
            seq_len=2,
            world_size=2,
            strategy="fsdp2",
            tensor_parallel=2,
            tp_plan={"net.0": "colwise", "net.2": "rowwise"},
            sequence_parallel=True,
        )


@pytest.mark.parametrize(("tp", "seq_len"), [(1, 8), (2, 7)])
def test_a_run_refuses_a_sequence_it_cannot_cut(tp: int, seq_len: int) -> None:
    config = ParallelConfig(dim=32, n_heads=4, n_layers=1, seq_len=seq_len, hidden=64)
    with pytest.raises(ValueError, match="divisible by tp"):
        train_2d(0, tp, 1, tp, config=config, sequence_parallel=True, device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel": 3}, "divide world_size"),
        ({"tensor_parallel": 0}, "divide world_size"),
        ({"tensor_parallel": True}, "int >= 1"),
        ({"tensor_parallel": 2, "strategy": "ddp"}, "strategy='fsdp2'"),
        ({"tensor_parallel": 2, "strategy": "fsdp2_hybrid"}, "strategy='fsdp2'"),
        ({"tensor_parallel": 2, "tp_plan": {"attention.wq": "diagonal"}}, "colwise"),
        ({"tensor_parallel": 2, "tp_plan": {"nothing.here": "colwise"}}, "matches no layer"),
        ({"tensor_parallel": 2, "tp_plan": {"attention_norm": "colwise"}}, "cuts an nn.Linear"),
        (
            {"tensor_parallel": 4, "tp_plan": {"w1": "colwise", "w2": "rowwise"}, "world_size": 8},
            "",
        ),
    ],
)
def test_a_bad_tensor_parallel_request_is_a_plan_error(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {
        "batch_size": 2,
        "seq_len": 8,
        "world_size": 4,
        "strategy": "fsdp2",
        "batch": _tokens,
        **kwargs,
    }
    if not message:  # a valid request: it plans
        assert plan(lambda: ParallelTransformer(CONFIG), **args).tensor_parallel == 4
        return
    with pytest.raises(PlanError, match=message):
        plan(lambda: ParallelTransformer(CONFIG), **args)


def test_features_that_do_not_divide_are_named() -> None:
    with pytest.raises(PlanError, match="not divisible by tensor_parallel=3"):
        plan(
            lambda: ParallelTransformer(CONFIG),
            batch_size=1,
            seq_len=8,
            world_size=3,
            strategy="fsdp2",
            tensor_parallel=3,
            batch=_tokens,
        )


def test_a_model_without_a_tp_plan_needs_one() -> None:
    with pytest.raises(PlanError, match="has no tp_plan"):
        plan(MLP(), batch_size=2, seq_len=1, world_size=2, strategy="fsdp2", tensor_parallel=2)
    cut = plan(
        MLP(),
        batch_size=2,
        seq_len=1,
        world_size=2,
        strategy="fsdp2",
        tensor_parallel=2,
        tp_plan={"net.0": "colwise", "net.2": "rowwise"},
    )
    assert cut.communication.payload["all_reduce"] > 0


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_estimate_plans_a_tensor_parallel_degree(
    capsys: pytest.CaptureFixture[str], sequence_parallel: bool
) -> None:
    import json

    from fsdp_guide.cli import main

    model = "fsdp_guide.parallel:ParallelTransformer"
    args = ["estimate", "--model", model, "--world-size", "4", "--precision", "fp32"]
    tp = ["--tensor-parallel", "2", "--batch-size", "4", "--json"]
    assert main([*args, *tp, *(["--sequence-parallel"] if sequence_parallel else [])]) == 0
    rows = json.loads(capsys.readouterr().out)
    want = plan(
        ParallelTransformer,
        batch_size=4,
        seq_len=16,
        world_size=4,
        strategy="fsdp2",
        tensor_parallel=2,
        sequence_parallel=sequence_parallel,
        batch=_tokens,
    )
    assert rows == [want.as_dict(rank) for rank in range(4)]
    assert (rows[0]["tensor_parallel"], rows[0]["sequence_parallel"]) == (2, sequence_parallel)
    # Sequence parallelism cuts over the tensor-parallel ranks: without them, an error.
    assert main([*args, "--sequence-parallel"]) != 0
    assert "pass --tensor-parallel T" in capsys.readouterr().err


def test_estimate_refuses_a_tensor_parallel_degree_without_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fsdp_guide.cli import main

    assert main(["estimate", "--params", "7B", "--tensor-parallel", "2"]) != 0
    assert "--tensor-parallel needs a real model" in capsys.readouterr().err
