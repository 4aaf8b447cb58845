"""The planner's gradient accumulation, frozen parameters and tied weights against real runs.

One launch of 2 gloo ranks trains the same small transformer every way the planner plans
(``practice_targets.everything``); each test compares one figure per rank to the byte.
"""

from __future__ import annotations

from typing import Any

import pytest
from practice_targets import BATCH, CONFIG, everything, lora_llama, tiny

from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import plan

WORLD = 2
FROZEN = ("tok_emb", "pos_emb", "blocks.0")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return launch(everything, world_size=WORLD, timeout=300)


def _plan(builder: Any = tiny, strategy: str = "fsdp2", **kwargs: Any) -> Any:
    return plan(
        builder,
        batch_size=BATCH,
        seq_len=CONFIG.seq_len,
        world_size=WORLD,
        strategy=strategy,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("strategy", "sync_each"),
    [("fsdp2", False), ("fsdp2", True), ("ddp", False), ("fsdp", False)],
)
def test_accumulation_holds_and_sends_what_the_plan_says(
    runs: list[dict[str, Any]], strategy: str, sync_each: bool
) -> None:
    planned = _plan(
        strategy=strategy, grad_accumulation=3, sync_each_micro_step=sync_each
    ).accumulation
    for rank, run in enumerate(runs):
        measured = run["accumulate"][(strategy, sync_each)]
        assert measured["held"] == planned.held[rank]
        assert measured["collectives"] == dict(planned.payload)


def test_holding_the_sync_back_costs_fsdp2_the_whole_gradients(
    runs: list[dict[str, Any]],
) -> None:
    off, on = (runs[0]["accumulate"][("fsdp2", s)] for s in (False, True))
    whole = 4 * sum(p.numel() for p in tiny().parameters())
    assert off["held"] == whole == WORLD * on["held"]  # no padding in this model
    assert 3 * off["collectives"]["reduce_scatter"] == on["collectives"]["reduce_scatter"]


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_frozen_parameters_have_no_gradients_state_or_reduction(
    runs: list[dict[str, Any]], strategy: str
) -> None:
    by_names = _plan(strategy=strategy, trainable=["blocks.1.*", "ln_f.*", "head.*"])
    by_flags = _plan(lambda: tiny(FROZEN), strategy=strategy)
    assert by_names.ranks == by_flags.ranks
    assert by_flags.frozen_params == sum(
        p.numel() for n, p in tiny().named_parameters() if n.startswith(FROZEN)
    )
    for rank, run in enumerate(runs):
        measured = run["frozen"][strategy]
        assert measured["state"] == by_flags.ranks[rank]
        assert measured["collectives"] == dict(by_flags.communication.payload)


def test_lora_adapters_alone_have_gradients_and_optimizer_state(
    runs: list[dict[str, Any]],
) -> None:
    if runs[0]["lora"] is None:
        pytest.skip("peft is not installed (the peft extra)")
    planned = _plan(lora_llama)
    assert 0 < planned.trainable_params < planned.frozen_params
    for rank, run in enumerate(runs):
        assert run["lora"]["state"] == planned.ranks[rank]
        assert run["lora"]["collectives"] == dict(planned.communication.payload)


@pytest.mark.parametrize("together", [False, True], ids=["root", "one-unit"])
def test_tied_weights_in_either_placement(runs: list[dict[str, Any]], together: bool) -> None:
    class EmbedAndHead:  # the blocks, then the embedding and the head as one unit
        def select(self, model: Any) -> list[str]:
            return ["blocks.0", "blocks.1", "tok_emb+head"]

    planned = _plan(lambda: tiny(tied=True), policy=EmbedAndHead() if together else "blocks")
    assert planned.num_params == sum(p.numel() for p in tiny(tied=True).parameters())
    for rank, run in enumerate(runs):
        measured = run["tied"][together]
        assert measured["state"] == planned.ranks[rank]
        assert measured["collectives"] == dict(planned.communication.payload)
    assert runs[0]["tied"][True]["loss"] == runs[0]["tied"][False]["loss"]


def test_a_split_tied_parameter_is_refused_like_fully_shard_refuses_it(
    runs: list[dict[str, Any]],
) -> None:
    class EmbeddingApart:
        def select(self, model: Any) -> list[str]:
            return ["tok_emb"]

    assert "shared" in runs[0]["split"] and "fully_shard([" in runs[0]["split"]
    with pytest.raises(PlanError, match=r"tok_emb.weight is tied.*one unit.*root"):
        _plan(lambda: tiny(tied=True), policy=EmbeddingApart())


@pytest.mark.parametrize("reduce_fp32", [None, False, True], ids=["fp32", "bf16", "bf16+fp32"])
def test_mixed_precision_bytes_per_kind(runs: list[dict[str, Any]], reduce_fp32: bool) -> None:
    precision = "fp32" if reduce_fp32 is None else "mixed"
    settings = {"reduce_dtype": "fp32"} if reduce_fp32 else None
    planned = _plan(precision=precision, settings=settings, grad_accumulation=2)
    for rank, run in enumerate(runs):
        measured = run["mixed"][reduce_fp32]
        assert measured["state"] == planned.ranks[rank]  # the fp32 state either way
        assert measured["bytes"] == planned.accumulation.payload_bytes
        assert measured["held"] == planned.accumulation.held[rank]
    fp32 = runs[0]["mixed"][None]["loss"]
    assert abs(runs[0]["mixed"][True]["loss"] - fp32) < 0.02 * fp32  # bf16 forward


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_accumulation": 0}, "grad_accumulation must be an int >= 1"),
        ({"grad_accumulation": 2.0}, "grad_accumulation must be an int >= 1"),
        ({"grad_accumulation": 2, "sync_each_micro_step": "no"}, "must be True or False"),
        ({"grad_accumulation": 2, "strategy": "oss"}, "planned for ddp, fsdp1, fsdp2"),
        ({"grad_accumulation": 2, "strategy": "deepspeed_zero2"}, "gradient_accumulation_steps"),
        ({"trainable": ["nothing.*"]}, "matches no parameter"),
        ({"trainable": "head.*"}, "list of parameter-name patterns"),
        ({"trainable": ["head.*"], "strategy": "fsdp"}, "planned for ddp and fsdp2"),
        ({"settings": {"reduce_dtype": "bf16"}}, "reduce_dtype must be None or 'fp32'"),
        ({"grad_accumulation": 2, "context_parallel": 2}, "grad_accumulation > 1 with pipe"),
        ({"trainable": ["head.*"], "context_parallel": 2}, "frozen parameters with pipeline"),
    ],
)
def test_bad_values_are_refused_before_anything_is_traced(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        _plan(**kwargs)
