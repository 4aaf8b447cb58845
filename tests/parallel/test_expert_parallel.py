"""Expert parallelism: the layer against transformers' Mixtral block, and the planner's figures
against training runs on 2 ranks (2 experts each) and 4 ranks (expert groups of 2, each
rank's experts sharded over 2), one launch per world size."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from cp_ep_targets import expert_parallel_checks, moe_block

from fsdp_guide.cli import main
from fsdp_guide.errors import PlanError
from fsdp_guide.launcher import launch
from fsdp_guide.memory import plan
from fsdp_guide.parallel import ExpertParallelMoE, ParallelTransformer, reference_moe_losses

CONFIG = transformers.MixtralConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=32,
)
BATCH, SEQ, EP = 4, 8, 2
#: Gradients summed over ranks in another order than in one process.
TOLERANCE = 1e-5


def _mixtral() -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_config(CONFIG)  # type: ignore[no-any-return]


Runs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def launches() -> Callable[[int], Runs]:
    """The run of each world size, launched once (the layer is checked on 2 ranks)."""
    done: dict[int, Runs] = {}

    def get(ranks: int) -> Runs:
        if ranks not in done:
            args = (EP, CONFIG, ranks == 2)
            done[ranks] = launch(expert_parallel_checks, ranks, args=args, start_method="fork")
        return done[ranks]

    return get


@pytest.fixture(params=[2, 4], ids=["2 ranks", "4 ranks"])
def launched(request: pytest.FixtureRequest, launches: Callable[[int], Runs]) -> tuple[int, Runs]:
    return int(request.param), launches(int(request.param))


@pytest.fixture
def layers(launches: Callable[[int], Runs]) -> list[dict[str, Any]]:
    """What the layer's checks returned on each of 2 ranks."""
    return [r["layer"] for r in launches(2)]


def _plan(world_size: int, routing: Any = None, activations: int = 0) -> Any:
    return plan(
        _mixtral,
        batch_size=BATCH // world_size,
        seq_len=SEQ,
        world_size=world_size,
        strategy="fsdp2",
        expert_parallel=EP,
        expert_routing=routing,
        activations=activations,
    )


def test_the_layer_equals_the_whole_block(layers: list[dict[str, Any]]) -> None:
    for layer in layers:
        assert max(layer["errors"].values()) < TOLERANCE, layer["errors"]


def test_all_to_all_elements_are_planned_from_the_routing(layers: list[dict[str, Any]]) -> None:
    from fsdp_guide.memory._ep import MoELayer, all_to_all_elements

    routing = [list(layer["routing"].sent) for layer in layers]
    moe = MoELayer(name="block", num_experts=4, hidden=16, top_k=2)
    planned = all_to_all_elements(moe, tokens=3 * 5, e=2, routing=routing)
    assert [layer["all_to_all"] for layer in layers] == list(planned)
    # What each rank's experts received is what the others sent them.
    for rank, layer in enumerate(layers):
        received = [row[rank * 2 : rank * 2 + 2] for row in routing]
        assert [list(r) for r in layer["routing"].received] == received


def test_a_capacity_drops_the_copies_past_it(layers: list[dict[str, Any]]) -> None:
    for layer in layers:
        capped, uncapped = layer["capped"], layer["uncapped"]
        capacity = math.ceil(0.5 * 15 * 2 / 4)  # factor x tokens x top_k / experts
        assert capped.capacity == capacity
        assert list(capped.sent) == [min(n, capacity) for n in uncapped]
        assert capped.dropped == sum(max(0, n - capacity) for n in uncapped) > 0


def test_a_skewed_router_loads_one_rank(layers: list[dict[str, Any]]) -> None:
    balanced = [layer["routing"].received_total for layer in layers]
    skewed = [layer["skewed"].received_total for layer in layers]
    assert sum(skewed) == sum(balanced) == 2 * 2 * 15  # every copy lands somewhere
    assert skewed[0] > max(balanced) and skewed[1] < min(balanced)


def test_each_rank_holds_and_sends_what_is_planned(launched: Any) -> None:
    world, ranks = launched
    runs = [r["trained"] for r in ranks]
    for group in range(world // EP):  # each expert-parallel group routes its own tokens
        members = runs[group * EP : (group + 1) * EP]
        routing = [[list(m["routing"][layer].sent) for m in members] for layer in range(2)]
        planned = _plan(world, routing)
        assert [r["state"] for r in runs] == list(planned.ranks)
        for position, run in enumerate(members):
            fsdp = {k: v for k, v in planned.communication.payload.items() if k != "all_to_all"}
            assert run["collectives"] == {**fsdp, "all_to_all": planned.all_to_all[position]}


def test_experts_per_rank_are_e_over_ep() -> None:
    whole = _plan(2).state  # experts over 2 ranks, each holding 2 of 4
    experts = sum(p.numel() for n, p in _mixtral().named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in _mixtral().parameters()) - experts
    # Adam's step per tensor on top of 16 bytes per element; FSDP2 pads nothing here.
    steps = 4 * (len(list(_mixtral().parameters())))
    assert whole.total == 16 * (dense // 2 + experts // EP) + steps


def test_training_equals_one_process(launched: Any) -> None:
    _, ranks = launched
    single = torch.tensor(reference_moe_losses(CONFIG, batch_size=BATCH, seq_len=SEQ))
    means = torch.tensor([r["trained"]["losses"] for r in ranks]).mean(0)
    assert torch.allclose(means, single, rtol=1e-5, atol=0)


def test_a_balancing_loss_evens_a_skewed_router() -> None:
    # transformers' auxiliary loss (Switch Transformer's): E * sum_i f_i * P_i over the
    # experts, minimal when the tokens spread evenly. Trained alone, it undoes a skew.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    block = moe_block()
    moe = ExpertParallelMoE(block)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)) + 0.5
    with torch.no_grad():
        moe.gate.weight[:2] += 1.0  # rank 0's experts of 2 ranks
    optimizer = torch.optim.SGD(moe.gate.parameters(), lr=2.0)

    def rank0_share() -> float:
        with torch.no_grad():
            moe(x)
        return sum(moe.routing.sent[:2]) / sum(moe.routing.sent)

    before = rank0_share()
    for _ in range(30):
        moe(x)
        loss = load_balancing_loss_func((moe.router_logits,), 4, 2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = rank0_share()
    assert before > 0.9 and abs(after - 0.5) < 0.05


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_parallel": 3, "world_size": 6}, "4 experts, not divisible by expert_parallel=3"),
        ({"expert_parallel": 4}, "divide the 2 data-parallel ranks"),
        ({"expert_parallel": 2, "activations": None}, "needs the bytes one rank's forward saves"),
        ({"expert_parallel": 2, "strategy": "ddp"}, "strategy='fsdp2'"),
        ({"expert_parallel": 2, "expert_routing": [[1, 2, 3, 4]]}, "2 rows"),
        ({"expert_parallel": 2, "expert_routing": [[[1] * 4] * 2] * 3}, "3 layers' routings"),
        ({"expert_routing": [[1] * 4] * 2}, "pass both"),
        ({"expert_parallel": 2, "world_size": 4, "tensor_parallel": 2}, "not planned: pick one"),
    ],
)
def test_bad_expert_parallel_is_refused(kwargs: dict[str, Any], message: str) -> None:
    settings = {"batch_size": 1, "seq_len": 8, "world_size": 2, "strategy": "fsdp2",
                "activations": 0, **kwargs}  # fmt: skip
    with pytest.raises(PlanError, match=message):
        plan(_mixtral, **settings)


def test_a_dense_model_is_refused() -> None:
    with pytest.raises(PlanError, match="ParallelTransformer is a dense model"):
        plan(ParallelTransformer, batch_size=1, seq_len=16, world_size=2, strategy="fsdp2",
             expert_parallel=2, activations=0)  # fmt: skip


def test_estimate_refuses_a_dense_model_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "fsdp_guide.parallel:ParallelTransformer", "--activations", "1MB"]
    assert main(["estimate", *argv, "--expert-parallel", "2", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a dense model" in err and "\n" not in err


def test_estimate_refuses_experts_that_do_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--hf", "mixtral", "--hf-arg", "num_hidden_layers=1", "--activations", "1MB"]
    assert main(["estimate", *argv, "--expert-parallel", "3", "--world-size", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert "8 experts, not divisible by expert_parallel=3" in err and "\n" not in err


def test_a_qwen_moe_block_with_its_shared_expert_is_computed_alike() -> None:
    # Qwen-MoE: the router holds top_k, and a shared expert (gated) sees every token.
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = transformers.Qwen2MoeConfig(
        hidden_size=16,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    moe = ExpertParallelMoE(block)  # one process: every expert
    assert moe.shared_expert is block.shared_expert
    assert torch.allclose(moe(x), block(x), atol=TOLERANCE)
