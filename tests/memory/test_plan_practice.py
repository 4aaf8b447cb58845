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
    # As the run's MixedPrecisionPolicy: reduce_dtype=torch.float32, or None (the bf16
    # parameters' dtype); plan()'s own default is fp32, as the guide's scripts set it.
    reduce_dtype = None if reduce_fp32 is None else "fp32" if reduce_fp32 else "bf16"
    planned = _plan(
        precision=precision,
        reduce_dtype=reduce_dtype,
        grad_accumulation=2,
        sync_each_micro_step=False,  # as the run: the first micro-step holds the sync back
    )
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
        ({"grad_accumulation": 2, "sync_each_micro_step": "no"}, "must be True, False or None"),
        (
            {"grad_accumulation": 2, "sync_each_micro_step": True, "strategy": "oss"},
            "sync_each_micro_step=True is planned for ddp, fsdp1, fsdp2",
        ),
        (
            {"grad_accumulation": 2, "sync_each_micro_step": False, "strategy": "deepspeed_zero2"},
            "gradient_accumulation_steps",
        ),
        (
            {
                "grad_accumulation": 2,
                "sync_each_micro_step": False,
                "precision": "mixed",
                "strategy": "fsdp",
            },
            "FSDP1's no_sync",
        ),
        ({"trainable": ["nothing.*"]}, "matches no parameter"),
        ({"trainable": "head.*"}, "list of parameter-name patterns"),
        ({"trainable": ["head.*"], "strategy": "fsdp"}, "planned for ddp and fsdp2"),
        ({"reduce_dtype": "fp16"}, "reduce_dtype must be 'fp32', 'bf16' or None"),
        ({"grad_accumulation": 2, "context_parallel": 2}, "grad_accumulation > 1 with pipe"),
        ({"trainable": ["head.*"], "context_parallel": 2}, "frozen parameters with pipeline"),
    ],
)
def test_bad_values_are_refused_before_anything_is_traced(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        _plan(**kwargs)


@pytest.mark.parametrize(
    ("strategy", "own"),
    [("fsdp2", True), ("fsdp", True), ("ddp", False), ("deepspeed_zero3", True)],
)
def test_each_engine_accumulates_its_own_way_by_default(strategy: str, own: bool) -> None:
    # sync_each_micro_step=None is the engine's own way; the plan's communication is the
    # optimizer step's, the accumulation's payload, built from one micro-step's.
    one = _plan(strategy=strategy)
    four = _plan(strategy=strategy, grad_accumulation=4)
    assert four.accumulation.sync_each_micro_step is own
    assert dict(four.communication.payload) == dict(four.accumulation.payload)
    for kind, n in one.communication.payload.items():
        reduces = kind in ("all_reduce", "reduce_scatter")
        assert four.communication.payload[kind] == (n if reduces and not own else 4 * n), kind


def test_held_back_sync_counts_the_whole_gradients_in_the_step_peak() -> None:
    # FSDP2 with the sync held back keeps every unsharded gradient through each micro-step.
    one = _plan(grad_accumulation=1)
    held, synced = (_plan(grad_accumulation=4, sync_each_micro_step=s) for s in (False, True))
    whole = 4 * sum(p.numel() for p in tiny().parameters())
    assert held.accumulation.held[0] == whole
    assert held.step_peak - one.step_peak == whole
    assert synced.step_peak - one.step_peak == one.state.grads
