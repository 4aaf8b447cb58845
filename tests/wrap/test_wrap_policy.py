"""Wrap policies: same decisions as the libraries' own, same units from their own walks."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from fairscale.nn.wrap import auto_wrap, enable_wrap
from torch import nn
from torch.distributed.fsdp.wrap import (
    _recursive_wrap,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_guide.models import MLP, Block, TinyTransformer, TransformerConfig, count_params
from fsdp_guide.wrap import (
    AnyOf,
    LayerPolicy,
    SizePolicy,
    WrapPolicy,
    any_of,
    checkpoint_layers,
    describe,
    selected_modules,
    sharded_units,
)

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)


def build(name: str = "transformer") -> nn.Module:
    torch.manual_seed(0)
    if name == "attention":  # has a MultiheadAttention, a force-leaf type of the size rule
        return nn.Sequential(nn.MultiheadAttention(64, 4), nn.ModuleList([nn.Linear(64, 64)]))
    return TinyTransformer(CONFIG) if name == "transformer" else MLP(hidden=64)


POLICIES: dict[str, WrapPolicy] = {
    "size-2k": SizePolicy(2_000),
    "size-5k": SizePolicy(5_000),
    "size-huge": SizePolicy(10**9),
    "layer": LayerPolicy(Block),
    "layer-linear": LayerPolicy(nn.Linear),
    "union": LayerPolicy(nn.Embedding) | SizePolicy(10_000),
    "union-3": any_of(LayerPolicy(nn.LayerNorm), SizePolicy(4_000), LayerPolicy(nn.Embedding)),
}
MODELS = ["transformer", "mlp", "attention"]


class Marker(nn.Module):
    """Stands in for an FSDP class: lets the libraries' walks run on CPU without ranks."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module


def marked_names(model: nn.Module) -> list[str]:
    """Names of the Marker-wrapped modules, with the ``.module`` hops removed."""
    return sorted(
        name.replace(".module", "") for name, m in model.named_modules() if isinstance(m, Marker)
    )


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_fairscale_auto_wrap_makes_the_selected_units(model_name: str, policy_name: str) -> None:
    policy = POLICIES[policy_name]
    expected = sorted(policy.select(build(model_name)))
    with enable_wrap(wrapper_cls=Marker, auto_wrap_policy=policy.for_fairscale()):
        wrapped = auto_wrap(build(model_name))
    assert not isinstance(wrapped, Marker)  # the root is left to shard()
    assert marked_names(wrapped) == expected


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_torch_recursive_wrap_makes_the_selected_units(model_name: str, policy_name: str) -> None:
    """FSDP1 runs this walk (only_wrap_children=True) before wrapping the root."""
    policy = POLICIES[policy_name]
    expected = sorted(policy.select(build(model_name)))
    model = build(model_name)
    _recursive_wrap(
        model,
        auto_wrap_policy=policy.for_torch(),
        wrapper_cls=Marker,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    assert marked_names(model) == expected


@pytest.mark.parametrize("min_num_params", [1, 500, 4_224, 10_000])
@pytest.mark.parametrize("numel", [0, 499, 500, 4_224, 50_000])
@pytest.mark.parametrize("recurse", [True, False])
def test_size_policy_decides_like_torch(min_num_params: int, numel: int, recurse: bool) -> None:
    torch_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    for module in [*build().modules(), *build("attention").modules()]:
        ours = SizePolicy(min_num_params).decide(module, recurse, numel)
        assert ours == torch_policy(module=module, recurse=recurse, nonwrapped_numel=numel)


@pytest.mark.parametrize("recurse", [True, False])
def test_layer_policy_decides_like_torch(recurse: bool) -> None:
    torch_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    decisions = []
    for module in build().modules():
        ours = LayerPolicy(Block).decide(module, recurse, 0)
        assert ours == torch_policy(module=module, recurse=recurse, nonwrapped_numel=0)
        decisions.append(ours)
    assert any(decisions)
    assert recurse or not all(decisions)


def test_union_is_flat_and_decides_like_any() -> None:
    size, layer = SizePolicy(10_000), LayerPolicy(nn.Embedding)
    union = layer | size
    assert isinstance(union, AnyOf)
    extra = LayerPolicy(nn.Linear)
    assert (union | extra).policies == (layer, size, extra)
    for module in build().modules():
        for numel in (0, 10_000):
            expected = size.should_wrap(module, numel) or layer.should_wrap(module, numel)
            assert union.should_wrap(module, numel) == expected


def test_union_selects_the_union_of_units_when_disjoint() -> None:
    model = build()
    layer, size = LayerPolicy(nn.Embedding), SizePolicy(10_000)
    assert set((layer | size).select(model)) == set(layer.select(model)) | set(size.select(model))


def test_selection_is_children_first() -> None:
    names = SizePolicy(4_000).select(build())
    for i, name in enumerate(names):
        for later in names[i + 1 :]:
            assert not later.startswith(name + "."), f"{later} comes after its parent {name}"
    assert "blocks.0.fc1" in names and "blocks.0" in names


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_planned_units_cover_every_parameter_once(policy_name: str) -> None:
    model = build()
    units = sharded_units(model, policy=POLICIES[policy_name])
    assert set(units) == {""} | set(POLICIES[policy_name].select(model))
    assert sum(n for _, n in units.values()) == count_params(model)
    assert all(kind == "planned" for kind, _ in units.values())


def test_describe_size_policy() -> None:
    text = describe(build(), policy=SizePolicy(2_000), max_depth=3)
    marked = {line.strip() for line in text.splitlines() if "[unit:" in line}
    assert marked == {
        # pos_emb 512 + ln_f 64 + what each block keeps besides qkv, fc1, fc2 (2 x 1,184)
        "(root): TinyTransformer  [unit: planned, 2,944 params]",
        "tok_emb: Embedding  [unit: planned, 2,048 params]",
        "qkv: Linear  [unit: planned, 3,168 params]",
        "fc1: Linear  [unit: planned, 4,224 params]",
        "fc2: Linear  [unit: planned, 4,128 params]",
        "head: Linear  [unit: planned, 2,048 params]",
    }
    assert text.count("qkv: Linear  [unit") == 2


def test_describe_layer_and_union_policies() -> None:
    layer = describe(build(), policy=LayerPolicy(Block))
    assert [line.strip() for line in layer.splitlines() if "[unit:" in line] == [
        "(root): TinyTransformer  [unit: planned, 4,672 params]",
        "0: Block  [unit: planned, 12,704 params]",
        "1: Block  [unit: planned, 12,704 params]",
    ]
    union = describe(build(), policy=LayerPolicy(nn.Embedding) | SizePolicy(10_000))
    assert [line.strip() for line in union.splitlines() if "[unit:" in line] == [
        "(root): TinyTransformer  [unit: planned, 2,112 params]",
        "tok_emb: Embedding  [unit: planned, 2,048 params]",
        "pos_emb: Embedding  [unit: planned, 512 params]",
        "0: Block  [unit: planned, 12,704 params]",
        "1: Block  [unit: planned, 12,704 params]",
    ]


@pytest.mark.parametrize("implementation", ["torch", "fairscale"])
@pytest.mark.parametrize("policy_name", ["size-2k", "layer", "union"])
def test_planned_units_of_a_checkpointed_model(implementation: str, policy_name: str) -> None:
    """Checkpoint wrappers are looked through: the plan is the plain model's."""
    policy = POLICIES[policy_name]
    checkpointed = checkpoint_layers(build(), Block, implementation=implementation)  # type: ignore[arg-type]
    assert sharded_units(checkpointed, policy=policy) == sharded_units(build(), policy=policy)
    text = describe(checkpointed, policy=policy)
    assert text.count("[checkpointed]") == CONFIG.n_layers
    if policy_name == "layer":
        assert text.count("Block  [unit: planned, 12,704 params]  [checkpointed]") == 2


def test_describe_unwrapped_model_has_no_units_and_respects_depth() -> None:
    text = describe(build(), max_depth=1)
    assert "[unit" not in text
    assert text.splitlines() == [
        "(root): TinyTransformer",
        "  tok_emb: Embedding",
        "  pos_emb: Embedding",
        "  blocks: ModuleList",
        "  ln_f: LayerNorm",
        "  head: Linear",
    ]


def test_selected_modules_returns_the_module_objects() -> None:
    model = build()
    for name, module in selected_modules(model, LayerPolicy(Block)):
        assert model.get_submodule(name) is module


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SizePolicy(0), ValueError, "min_num_params must be >= 1"),
        (lambda: SizePolicy(1e5), ValueError, r"SizePolicy\(min_num_params=100_000\)"),
        (lambda: SizePolicy(True), ValueError, "positive int"),
        (lambda: LayerPolicy(), TypeError, r"at least one layer class, e.g. LayerPolicy\(Block\)"),
        (lambda: LayerPolicy(Block(8, 2)), TypeError, "pass the class itself"),
        (lambda: LayerPolicy("Block"), TypeError, "pass the class itself"),
        (lambda: AnyOf(), TypeError, "at least one policy"),
        (lambda: AnyOf(LayerPolicy(Block), Block), TypeError, r"wrap classes in LayerPolicy"),
        (lambda: LayerPolicy(Block) | Block, TypeError, "unsupported operand"),
        (lambda: selected_modules(build(), Block), TypeError, "policy must be a WrapPolicy"),
    ],
)
def test_bad_policy_arguments(make: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()
