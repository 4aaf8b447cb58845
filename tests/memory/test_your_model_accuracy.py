"""The planner on third-party models: planned == measured per rank, on real gloo runs.

Tiny transformers models built from config classes (see ``hf_models``). The full matrix of
models, strategies and world sizes is ``benchmarks/your_model_matrix.py``; here one launch of
2 ranks covers each model and each strategy, and each defect once: the unit policy
(FSDP1/FSDP2 units on a transformers model), FSDP2's row padding, FSDP1's flat-parameter
padding, ZeRO-3's per-tensor padding, DDP's buffer broadcasts, the attention path of a mask
of ones, GPT-2's tied head and T5's encoder-decoder; one launch of 4 ranks covers the
padding that only an uneven split over 4 shows.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import Logits, batch_fn, builder, measure_and_plan_many
from torch import nn

from fsdp_guide.engines import block_classes, model_shape, unit_names
from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import build_on_meta, plan, traced_activation_bytes
from fsdp_guide.models import MLP, Block, TinyTransformer, TransformerConfig, loss_fn
from fsdp_guide.wrap import LayerPolicy, saved_activation_bytes

transformers = pytest.importorskip("transformers")

CASES = [
    ("llama", "fsdp2"),  # units from _no_split_modules; the mask of ones
    ("vit", "fsdp2"),  # FSDP2 pads rows: 3 classes over 2 ranks
    ("resnet", "fsdp"),  # FSDP1 pads each unit's flat parameter
    ("bert", "ddp"),  # DDP broadcasts position_ids and token_type_ids before each forward
    ("resnet", "zero1"),  # ... and BatchNorm statistics, under ZeroRedundancyOptimizer too;
    # under both, what DDP sends once (the wrap's broadcasts, the buckets' new layout)
    ("vit", "deepspeed_zero3"),  # ZeRO-3 pads each tensor
    ("gpt2", "sharded_ddp"),  # the tied head: one parameter, one gradient, one owner
    ("gpt2", "deepspeed_zero3"),  # ... gathered once per use under ZeRO-3
    ("t5", "fsdp"),  # encoder and decoder blocks, keyword-only inputs
]
CASES_4 = [
    ("gpt2", "fsdp2"),
    ("bert", "fsdp"),
    ("resnet", "deepspeed_zero3"),
    ("t5", "ddp"),  # what DDP sends once, at the wrap and at its buckets' regrouping
]


Results = list[dict[str, dict[str, int]]]


def _measure_and_plan(world_size: int, cases: list[tuple[str, str]]) -> Results:
    """Every rank's measured and planned fields of each case, rank by rank, from one launch."""
    ranks = launch(
        measure_and_plan_many,
        world_size,
        args=(cases,),
        backend="gloo",
        start_method="fork",
        timeout=300 * world_size // 2,
    )
    return [case for rank in ranks for case in rank]


@pytest.fixture(scope="module")
def results() -> Results:
    return _measure_and_plan(2, CASES)


@pytest.fixture(scope="module")
def results_4() -> Results:
    return _measure_and_plan(4, CASES_4)


def _check_every_rank(results: Results, cases: list[tuple[str, str]], index: int) -> None:
    for rank in range(len(results) // len(cases)):
        found = results[rank * len(cases) + index]
        measured, planned = found["measured"], found["planned"]
        assert planned == measured, (cases[index], rank)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{m}-{s}" for m, s in CASES])
def test_planned_equals_measured(results: Results, index: int) -> None:
    _check_every_rank(results, CASES, index)


@pytest.mark.parametrize("index", range(len(CASES_4)), ids=[f"{m}-{s}" for m, s in CASES_4])
def test_planned_equals_measured_at_4_ranks(results_4: Results, index: int) -> None:
    _check_every_rank(results_4, CASES_4, index)


def test_the_cases_cover_every_model_and_strategy() -> None:
    from hf_models import MODELS

    strategies = {"ddp", "zero1", "sharded_ddp", "fsdp", "fsdp2", "deepspeed_zero3"}
    assert {m for m, _ in CASES} == set(MODELS) and {s for _, s in CASES} == strategies


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", "GPT2Block"),
        ("llama", "LlamaDecoderLayer"),
        ("t5", "T5Block"),
        ("bert", "BertLayer"),
    ],
)
def test_a_unit_per_transformer_block(name: str, expected: str) -> None:
    model = build_on_meta(builder(name))
    names = unit_names(model)
    assert names and {type(model.get_submodule(n)).__name__ for n in names} == {expected}
    assert unit_names(model, "root") == []


def test_a_block_sharing_a_tied_weight_stays_in_its_parent() -> None:
    # BERT declares its embeddings unsplittable, but their word embeddings are the head's.
    model = build_on_meta(builder("bert"))
    assert "BertEmbeddings" in {c.__name__ for c in block_classes(model)}
    assert not any(name.endswith("embeddings") for name in unit_names(model))


def test_without_transformers_the_repeated_children_of_a_module_list() -> None:
    model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
    assert block_classes(model) == (Block,)
    assert unit_names(model, LayerPolicy(nn.Linear))[0] == "blocks.0.qkv"
    assert block_classes(MLP()) == ()
    with pytest.raises(ValueError, match="unknown wrap rule 'layers'"):
        unit_names(model, "layers")  # type: ignore[arg-type]


def test_policy_changes_the_plan() -> None:
    kwargs = {"batch_size": 2, "seq_len": 16, "world_size": 2, "strategy": "fsdp"}
    blocks = plan(builder("gpt2"), batch=batch_fn("gpt2"), **kwargs)
    root = plan(builder("gpt2"), batch=batch_fn("gpt2"), policy="root", activations=0, **kwargs)
    shape = model_shape(build_on_meta(builder("gpt2")))
    psi = shape.num_params
    assert root.communication.payload == {"reduce_scatter": psi, "all_gather": psi}
    assert blocks.communication.payload["all_gather"] == 2 * psi - shape.root_params
    assert root.ranks[0].optimizer < blocks.ranks[0].optimizer  # one Adam step, not three


def test_a_mask_of_ones_is_traced_as_the_real_forward_takes_it() -> None:
    # transformers skips the mask (and repeats no K/V) only when it can read the mask's ones.
    model = builder("llama")()
    assert isinstance(model, Logits) and model.kind == "tokens_mask"
    x, y = batch_fn("llama")(4, 16)
    real, _ = saved_activation_bytes(model, lambda: loss_fn(model, (x, y)))
    assert traced_activation_bytes(model, 4, 16, batch=batch_fn("llama")) == real
    assert isinstance(real, int) and torch.is_tensor(x)


def _tiny_mixtral() -> nn.Module:
    """A one-layer Mixtral of 4 experts, 2 per token (transformers' grouped experts)."""
    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(config)


def test_a_mixture_of_experts_is_refused_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    def mixtral() -> nn.Module:
        return Logits(_tiny_mixtral(), "tokens")

    kwargs = {"batch_size": 2, "seq_len": 16, "world_size": 2, "strategy": "fsdp2"}
    with pytest.raises(PlanError, match="mixture-of-experts layers .MixtralExperts.") as caught:
        plan(mixtral, batch=batch_fn("llama"), **kwargs)
    assert "\n" not in str(caught.value) and "activations=" in str(caught.value)
    assert not [r for r in caplog.records if r.name.startswith("torch")]  # no tracer's log
    # The rest of the plan, with activations measured on one real forward:
    assert plan(mixtral, batch=batch_fn("llama"), activations=1000, **kwargs).activations == 1000


def test_compare_wraps_as_told_and_predicts_it() -> None:
    from fsdp_guide.compare import run_comparison
    from fsdp_guide.models import build_model, count_params

    with pytest.raises(ValueError, match="unknown wrap 'layers'"):
        run_comparison(["fsdp"], wrap="layers", progress=None)
    psi = count_params(build_model("transformer"))
    rows = run_comparison(["fsdp"], world_size=2, steps=1, batch_size=2, progress=None, wrap="root")
    for row in rows:  # the whole model one unit: gathered once, kept until backward
        assert row.comm_measured is not None and row.comm_predicted is not None
        assert row.comm_measured.elements_by_kind() == {"reduce_scatter": psi, "all_gather": psi}
        assert dict(row.comm_predicted.payload) == row.comm_measured.elements_by_kind()


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_mixed_precision_saves_what_is_planned(strategy: str) -> None:
    # FSDP1 and FSDP2 cast the parameters to bf16: no copies of the weights are saved. DDP
    # runs under autocast, which saves the bf16 copy of each weight it casts.
    from hf_models import bf16_saved

    (pairs, _) = launch(
        bf16_saved, 2, args=(["llama", "vit"], strategy), backend="gloo", start_method="fork"
    )
    assert [planned for _, planned in pairs] == [saved for saved, _ in pairs]


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp", "ddp"])
def test_mixed_precision_keeps_the_planned_state(strategy: str) -> None:
    # torch's mixed precision computes in bf16 but keeps fp32 parameters, gradients and Adam
    # moments (4 + 4 + 8 bytes per element, sharded or not): the same 16 bytes as ZeRO's
    # 2 + 2 + 12, split otherwise, and the plan says so field by field. FSDP gathers and
    # reduces in bf16; DDP's all-reduce under autocast sends the fp32 gradients.
    from hf_models import bf16_state

    ranks = launch(
        bf16_state, 2, args=(["llama", "vit"], strategy), backend="gloo", start_method="fork"
    )
    for rank, pairs in enumerate(ranks):
        for name, (measured, planned) in zip(["llama", "vit"], pairs, strict=True):
            assert planned == measured, (name, rank)


@pytest.mark.parametrize(("batch_size", "seq_len"), [(2, 16), (4, 32)])
def test_a_mixture_of_experts_in_bf16_saves_what_is_planned(batch_size: int, seq_len: int) -> None:
    # transformers' grouped experts sort the tokens by expert and run one grouped matmul:
    # the saved shapes do not depend on the routing, so a trace without data plans them.
    from fsdp_guide.inputs import example_batch

    model = _tiny_mixtral().to(torch.bfloat16)
    batch = example_batch(model)
    planned = traced_activation_bytes(
        model, batch_size, seq_len, precision="mixed", mixed="params", batch=batch.build
    )
    for seed in (0, 1):  # two batches, two routings
        torch.manual_seed(seed)
        data = batch.build(batch_size, seq_len)
        real, _ = saved_activation_bytes(model, lambda data=data: loss_fn(model, data))
        assert planned == real, seed
