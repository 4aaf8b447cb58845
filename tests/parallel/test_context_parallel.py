"""Context parallelism: ring attention against full attention, and the planner's figures
against real runs on 2 and 4 gloo ranks (one launch per world size)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cp_ep_targets import CASES, B, D, H, S, context_parallel_checks

from fsdp_guide.cli import main
from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import plan
from fsdp_guide.parallel import (
    ParallelConfig,
    ParallelTransformer,
    reference_losses,
    ring_attention,
    ring_schedule,
    shard_sequence,
)
from fsdp_guide.parallel._ring import ring_elements

CONFIG = ParallelConfig(dim=32, n_heads=4, n_layers=2, seq_len=16, hidden=64)
BATCH = 4
#: The training runs of each world size: (dp, cp, tp) = (1, 2, 1) on 2 ranks; (2, 2, 1) and
#: (1, 2, 2) on 4.
RUNS: dict[int, list[dict[str, Any]]] = {
    2: [{"cp": 2, "layout": "zigzag"}],
    4: [{"cp": 2, "layout": "naive"}, {"cp": 2, "tp": 2, "layout": "zigzag"}],
}
#: Ring attention in fp32 sums the same products in another order than one kernel does.
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def launched(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ranks = int(request.param)
    common = {"batch_size": BATCH, "config": CONFIG}
    runs = [{**common, **run} for run in RUNS[ranks]]
    return ranks, launch(context_parallel_checks, ranks, args=(runs,), start_method="fork")


def _tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return ids, ids.clone()


def _plan(world_size: int, cp: int, tp: int = 1, layout: str = "zigzag") -> Any:
    dp = world_size // (cp * tp)
    return plan(
        lambda: ParallelTransformer(CONFIG),
        batch_size=BATCH // dp,
        seq_len=CONFIG.seq_len,
        world_size=world_size,
        strategy="fsdp2",
        tensor_parallel=tp,
        context_parallel=cp,
        cp_layout=layout,
        batch=_tokens,
    )


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{'causal' if c else 'full'}-{lay}" for c, lay in CASES]
)
def test_ring_attention_equals_full_attention(launched: Any, case: tuple[bool, str]) -> None:
    _, ranks = launched
    for rank in ranks:
        errors = rank["ring"][case]["errors"]  # output, dq, dk, dv
        assert max(errors) < TOLERANCE, (case, errors)


def test_each_rank_sends_c_minus_1_blocks_each_way(launched: Any) -> None:
    world, ranks = launched
    block = ring_elements(B, H, S // world, D, world)
    assert block["send"] == 3 * (world - 1) * 2 * B * H * (S // world) * D
    for rank in ranks:
        for case in CASES:
            assert rank["ring"][case]["sent"] == block, case


def test_saved_activations_scale_with_the_share_of_the_sequence(launched: Any) -> None:
    world, ranks = launched
    tokens = S // world
    # q, k, v and the output (fp32), and the log-sum-exp of each query: all seq_len / c.
    expected = 4 * (4 * B * H * tokens * D) + 4 * B * H * tokens
    for rank in ranks:
        assert {rank["ring"][case]["saved"] for case in CASES} == {expected}


def test_each_step_computes_what_the_schedule_says(launched: Any) -> None:
    world, ranks = launched
    for index, rank in enumerate(ranks):
        for causal, layout in CASES:
            planned = ring_schedule(world, layout, causal)[index]  # type: ignore[arg-type]
            assert rank["ring"][causal, layout]["shares"] == planned


def test_zigzag_balances_the_causal_work() -> None:
    for c in (2, 4, 8):
        naive, zigzag = ring_schedule(c, "naive"), ring_schedule(c, "zigzag")
        total = sum(map(sum, naive))
        assert total == sum(map(sum, zigzag)) == c * (c + 1) / 2  # the same work in all
        # A step lasts as long as its busiest rank.
        assert sum(max(col) for col in zip(*naive, strict=True)) == c
        assert sum(max(col) for col in zip(*zigzag, strict=True)) == total / c
        assert all(len(set(col)) == 1 for col in zip(*zigzag, strict=True))  # no rank idle


def test_training_equals_one_process_and_the_plan(launched: Any) -> None:
    world, ranks = launched
    single = torch.tensor(reference_losses(steps=2, batch_size=BATCH, config=CONFIG))
    for index, kwargs in enumerate(RUNS[world]):
        runs = [r["trained"][index] for r in ranks]
        cp, tp = kwargs["cp"], kwargs.get("tp", 1)
        # Every rank's loss is its tokens' mean; a TP group's ranks share theirs.
        means = torch.tensor([r["losses"] for r in runs if r["tp_rank"] == 0]).mean(0)
        assert torch.allclose(means, single, rtol=1e-5, atol=0), kwargs
        planned = _plan(world, cp, tp, kwargs["layout"])
        assert [r["state"] for r in runs] == list(planned.ranks), kwargs
        assert {r["activations"] for r in runs} == {planned.activations}, kwargs
        expected = {kind: 4 * n for kind, n in planned.communication.payload.items()}
        assert {"send", "recv", "all_gather", "reduce_scatter"} <= set(expected)
        for r in runs:
            assert r["collectives"] == expected, kwargs


def test_activations_per_rank_shrink_with_the_ring() -> None:
    # The same samples per group, their tokens spread over 1, 2 and 4 ranks.
    one, two, four = (_plan(c, c).activations for c in (1, 2, 4))
    assert four < two < one
    # Every saved tensor is per token, but a few scalars of the loss: close to 1/c.
    assert abs(two / one - 1 / 2) < 0.01 and abs(four / one - 1 / 4) < 0.01


def test_one_rank_ring_is_plain_attention() -> None:
    q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)
    for causal in (False, True):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(ring_attention(q, k, v, causal=causal), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_parallel": 3}, "divide the 4 ranks"),
        ({"context_parallel": 4, "seq_len": 12}, "not divisible by 2 \\* context_parallel = 8"),
        ({"context_parallel": 4, "seq_len": 10, "cp_layout": "naive"}, "divisible by context_par"),
        ({"context_parallel": 2, "cp_layout": "ring"}, "cp_layout must be one of"),
        ({"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}, "pick one"),
    ],
)
def test_bad_context_parallel_is_refused(kwargs: dict[str, Any], message: str) -> None:
    settings = {"batch_size": 1, "seq_len": 16, "world_size": 4, "strategy": "fsdp2", **kwargs}
    with pytest.raises(PlanError, match=message):
        plan(lambda: ParallelTransformer(CONFIG), batch=_tokens, **settings)


def test_a_model_without_attention_is_refused() -> None:
    from fsdp_guide.models import build_model

    with pytest.raises(PlanError, match="calls no scaled_dot_product_attention"):
        plan(build_model("mlp"), batch_size=2, seq_len=4, world_size=2, strategy="ddp",
             context_parallel=2)  # fmt: skip


def test_shard_sequence_refuses_a_sequence_that_does_not_cut() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        shard_sequence(torch.arange(6), 0, 2, "zigzag", dim=0)


MODEL = ["--model", "fsdp_guide.parallel:ParallelTransformer"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7B", "--context-parallel", "2"], "needs a real model"),
        (
            [*MODEL, "--context-parallel", "3", "--world-size", "6", "--seq-len", "16"],
            "not divisible by 2 * context_parallel = 6",
        ),
    ],
)
def test_estimate_refuses_bad_context_parallel_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_estimate_plans_context_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", *MODEL, "--seq-len", "16", "--world-size", "4", "--json"]
    assert main([*argv, "--strategy", "fsdp2"]) == 0
    flat = capsys.readouterr().out
    assert main([*argv, "--strategy", "fsdp2", "--context-parallel", "2"]) == 0
    ring = capsys.readouterr().out
    import json

    (a, *_), (b, *_) = json.loads(flat), json.loads(ring)
    assert b["activations"] < a["activations"] and b["communication"] > a["communication"]
    assert b["model_state"] == a["model_state"]  # the ring cuts tokens, not weights
    assert (a["context_parallel"], b["context_parallel"]) == (1, 2)


def test_estimate_help_documents_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--context-parallel C", "--cp-layout {zigzag,naive}", "--expert-parallel E"):
        assert option in text
    assert "ring attention" in text and "all-to-alls" in text
