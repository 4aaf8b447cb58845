"""DDPFullyShardedStrategy's wrapping on CPU: FairScale FSDP wrappers can be *built* on CPU
(only their forward needs CUDA), so the wrap logic is checked here in a world of one gloo rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from fairscale.nn import FullyShardedDataParallel
from fairscale.nn.wrap import wrap
from strategy_helpers import SMALL_TRANSFORMER
from torch import nn

from fsdp_guide import find_free_port
from fsdp_guide.models import Block, TinyTransformer
from fsdp_guide.strategies import DDPFullyShardedStrategy
from fsdp_guide.strategies._fsdp_helpers import check_optimizers_use_sharded_params
from fsdp_guide.strategies._fully_sharded import USE_TRAINER_MODEL

N_LAYERS = SMALL_TRANSFORMER.n_layers  # each Block has 12,704 parameters


@pytest.fixture
def one_rank_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(find_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cpu_strategy(**kwargs: object) -> DDPFullyShardedStrategy:
    strategy = DDPFullyShardedStrategy(**kwargs)  # type: ignore[arg-type]
    strategy.parallel_devices = [torch.device("cpu")]
    return strategy


def count_fsdp(model: nn.Module) -> int:
    return sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())


@pytest.mark.parametrize(("min_num_params", "wrappers"), [(10_000, 1 + N_LAYERS), (10**8, 1)])
def test_auto_wrap_follows_min_num_params(
    one_rank_world: None, min_num_params: int, wrappers: int
) -> None:
    model = cpu_strategy(min_num_params=min_num_params)._wrap_model(
        TinyTransformer(SMALL_TRANSFORMER)
    )
    assert isinstance(model, FullyShardedDataParallel)
    assert count_fsdp(model) == wrappers


def test_manual_wrap_in_the_sharded_context_wins_over_auto_wrap(one_rank_world: None) -> None:
    strategy = cpu_strategy(min_num_params=10**8)
    model = TinyTransformer(SMALL_TRANSFORMER)
    first = model.blocks[0]
    assert wrap(first) is first  # outside the strategy's context: a no-op
    with strategy.model_sharded_context():  # what configure_model runs in
        model.blocks[0] = wrap(model.blocks[0])
    assert isinstance(model.blocks[0], FullyShardedDataParallel)
    wrapped = strategy._wrap_model(model)
    # The hand-wrapped block and the root; auto-wrap stays out when something was wrapped.
    assert count_fsdp(wrapped) == 2


def test_strategy_settings_reach_every_wrapper(one_rank_world: None) -> None:
    strategy = cpu_strategy(
        min_num_params=10_000,
        reshard_after_forward=False,
        bucket_cap_mb=5,
        flatten_parameters=False,
    )
    model = strategy._wrap_model(TinyTransformer(SMALL_TRANSFORMER))
    wrappers = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    assert len(wrappers) == 1 + N_LAYERS
    for fsdp in wrappers:
        assert fsdp.reshard_after_forward is False
        assert fsdp.bucket_cap_mb == 5
        assert fsdp.flatten_parameters is False
        assert fsdp.state_dict_device == torch.device("cpu")


def test_activation_checkpointing_patches_the_blocks_before_wrapping(one_rank_world: None) -> None:
    model = TinyTransformer(SMALL_TRANSFORMER)
    strategy = cpu_strategy(min_num_params=10_000, activation_checkpointing=[Block])
    strategy._wrap_model(model)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == N_LAYERS
    assert all("checkpointed" in str(b.forward) for b in blocks)


def test_optimizer_built_before_wrapping_is_refused(one_rank_world: None) -> None:
    model = TinyTransformer(SMALL_TRANSFORMER)
    stale = torch.optim.AdamW(model.parameters())  # the parameters FSDP is about to flatten
    wrapped = cpu_strategy(min_num_params=10_000)._wrap_model(model)
    fresh = torch.optim.AdamW(wrapped.parameters())
    check_optimizers_use_sharded_params([fresh], wrapped, USE_TRAINER_MODEL)
    with pytest.raises(ValueError, match=r"self\.trainer\.model\.parameters\(\)"):
        check_optimizers_use_sharded_params([stale], wrapped, USE_TRAINER_MODEL)


@pytest.mark.parametrize(
    ("precision", "mixed", "dtype"),
    [("32-true", False, None), ("bf16-mixed", True, torch.bfloat16)],
)
def test_fsdp_config_follows_precision(
    precision: str, mixed: bool, dtype: torch.dtype | None
) -> None:
    from pytorch_lightning.plugins.precision import MixedPrecision, Precision

    strategy = cpu_strategy(cpu_offload=True)
    strategy.precision_plugin = (
        Precision() if precision == "32-true" else MixedPrecision("bf16-mixed", "cpu")
    )
    config = strategy.fsdp_config()
    assert config["mixed_precision"] is mixed
    assert config["compute_dtype"] == dtype
    assert config["move_params_to_cpu"] is True and config["move_grads_to_cpu"] is True
    assert config["fp32_reduce_scatter"] is False


class LitTransformer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer(SMALL_TRANSFORMER)


@pytest.mark.parametrize(
    ("build_from", "error"),
    [
        ("trainer_model", None),
        # self.parameters() sees the blocks' shards but not the root's (embeddings, head).
        ("module", r"miss 1 sharded parameter.*self\.trainer\.model\.parameters\(\)"),
    ],
)
def test_optimizer_from_self_parameters_after_inner_wrapping_is_refused(
    one_rank_world: None, build_from: str, error: str | None
) -> None:
    module = LitTransformer()
    wrapped = cpu_strategy(min_num_params=10_000)._wrap_model(module)
    assert count_fsdp(wrapped) == 1 + N_LAYERS
    params = module.parameters() if build_from == "module" else wrapped.parameters()
    optimizer = torch.optim.AdamW(params)
    check = functools.partial(
        check_optimizers_use_sharded_params,
        [optimizer],
        wrapped,
        USE_TRAINER_MODEL,
        module_params=module.parameters(),
    )
    if error is None:
        check()
    else:
        with pytest.raises(ValueError, match=error):
            check()


def test_teardown_leaves_the_shards_on_their_device(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_fabric.plugins.environments import LightningEnvironment
    from pytorch_lightning.accelerators import CPUAccelerator

    strategy = cpu_strategy(min_num_params=10_000)
    strategy.accelerator = CPUAccelerator()
    strategy.cluster_environment = LightningEnvironment()
    module = LitTransformer()
    strategy.connect(module)
    strategy.model = strategy._wrap_model(module)
    moves: list[str] = []
    for name in ("cpu", "to"):
        monkeypatch.setattr(module, name, lambda *args, name=name, **kw: moves.append(name))
    torn_down: list[str] = []
    monkeypatch.setattr(strategy.accelerator, "teardown", lambda: torn_down.append("accelerator"))
    strategy.teardown()
    # Lightning's default would call module.cpu(): NCCL could not gather CPU shards afterwards.
    assert moves == []
    assert torn_down == ["accelerator"]
    assert isinstance(strategy.model, FullyShardedDataParallel)
