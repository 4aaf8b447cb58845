"""The engine adapters: one per engine, built from catalog rows, answering for their engine."""

from __future__ import annotations

import math
from typing import Any

import pytest
from torch import nn

from fsdp_guide.catalog import STRATEGIES, get_strategy
from fsdp_guide.engines import (
    ENGINES,
    FSDP1,
    FSDP2,
    DeepSpeedZero,
    Engine,
    Plain,
    ShardedDDP,
    engine_class,
    engine_for,
)

SHAPES = [(10, 3), (7,), (5, 5), (1,)]
TOTAL = sum(math.prod(s) for s in SHAPES)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_row_builds_its_engine_with_its_settings(name: str) -> None:
    spec = get_strategy(name)
    engine = engine_for(name)
    assert engine.name == spec.engine
    assert {k: getattr(engine, k) for k in spec.settings} == dict(spec.settings)


def test_every_engine_is_registered_once_by_a_unique_name() -> None:
    names = [e.name for e in ENGINES]
    assert len(names) == len(set(names))
    assert ENGINES[-1] is Plain  # the last one asked: it recognises every model


@pytest.mark.parametrize(
    ("engine", "settings", "message"),
    [
        ("fsdp1", {"sharding_strategy": "FULLY"}, "unknown sharding_strategy 'FULLY'"),
        ("fsdp1", {"shard_group": 2}, "shard_group is the size of HYBRID_SHARD's groups"),
        ("fsdp1", {"sharding_strategy": "HYBRID_SHARD"}, "shard_group is the size"),
        ("deepspeed", {"stage": 4}, "stage must be 0, 1, 2 or 3"),
        ("deepspeed", {"stage": 2, "offload_params": True}, "offload_params needs stage=3"),
        ("zero3", {}, "unknown engine 'zero3'"),
    ],
)
def test_bad_settings_are_refused_naming_the_fix(
    engine: str, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine_class(engine)(**settings)


def test_an_unknown_setting_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="reduce_buffer"):
        engine_class("ddp")(reduce_buffer_size=0)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_layout_has_a_rank_each_and_keeps_every_element_somewhere(
    name: str, world_size: int
) -> None:
    engine = engine_for(name)
    layouts = engine.layout(SHAPES, world_size)
    assert layouts is not None and len(layouts) == world_size
    group = engine.shard_group_size(world_size)
    # One shard group together holds the whole model's optimizer state, padding included.
    assert sum(s.optimizer + s.master for s in layouts[:group]) >= TOTAL
    assert all(s.params >= math.ceil(TOTAL / group) for s in layouts) or name.startswith("fsdp2")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_collectives_are_the_payload_of_one_step(name: str) -> None:
    issued = engine_for(name).collectives(1000, 4, root_unit_params=100)
    assert issued.payload and all(n > 0 for n in issued.payload.values())
    assert set(issued.groups) <= set(issued.payload)


def test_stages_at_the_step() -> None:
    stages = {name: engine_for(name).stage_at_step for name in STRATEGIES}
    assert stages["fsdp_grad_op"] == 3  # resharded after backward
    assert stages["fsdp_no_shard"] == 0
    assert all(stages[n] == STRATEGIES[n].zero_stage for n in stages if n != "fsdp_grad_op")


def test_shard_groups_and_full_gradients() -> None:
    assert FSDP1(sharding_strategy="HYBRID_SHARD", shard_group=2).shard_group_size(6) == 2
    assert FSDP1(sharding_strategy="HYBRID_SHARD", shard_group=4).shard_group_size(6) == 6
    assert ShardedDDP(reduce_buffer_size=2**23).full_grads
    assert not ShardedDDP().full_grads


def test_deepspeed_knows_its_layout_for_fp32_adam_only() -> None:
    engine = DeepSpeedZero(stage=3)
    assert engine.layout(SHAPES, 2) is not None
    assert engine.layout(SHAPES, 2, fp32_adam=False) is None
    assert engine.own_formula([TOTAL], 2) is not None
    assert FSDP2().own_formula([TOTAL], 2) is None


def test_a_plain_module_is_no_engine() -> None:
    engine = engine_for(nn.Linear(2, 2))
    assert isinstance(engine, Plain) and isinstance(engine, Engine)
    assert engine.collectives(10, 1).payload == {}


@pytest.mark.parametrize(
    ("source", "optimizer", "error"),
    [
        ("ddp", object(), "optimizer with a model only"),
        (3, None, "a strategy name, a StrategySpec or a model, got int"),
    ],
)
def test_engine_for_refuses_what_is_neither_a_strategy_nor_a_model(
    source: Any, optimizer: Any, error: str
) -> None:
    with pytest.raises(TypeError, match=error):
        engine_for(source, optimizer)


def test_engine_for_takes_a_catalog_row_as_its_name() -> None:
    from fsdp_guide.catalog import get_strategy

    assert engine_for(get_strategy("fsdp_grad_op")) == engine_for("fsdp_grad_op")
