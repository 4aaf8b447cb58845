"""Fast checks of the FairScale strategies that start no process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.strategies import _StrategyRegistry
from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision, Precision
from pytorch_lightning.strategies import StrategyRegistry
from torch import nn

from fsdp_guide.strategies import (
    STRATEGY_NAMES,
    DDPFullyShardedStrategy,
    DDPShardedStrategy,
    DDPSpawnShardedStrategy,
    ShardedMixedPrecision,
    ShardedPrecision,
    register_fairscale_strategies,
)
from fsdp_guide.strategies._fsdp_helpers import (
    apply_activation_checkpointing,
    check_optimizers_use_sharded_params,
    normalize_layer_classes,
)
from fsdp_guide.strategies._fully_sharded import USE_TRAINER_MODEL
from fsdp_guide.strategies._precision import to_sharded_precision


@pytest.mark.parametrize(
    ("name", "cls", "start_method"),
    [
        ("ddp_sharded", DDPShardedStrategy, "popen"),
        ("ddp_sharded_spawn", DDPSpawnShardedStrategy, "spawn"),
        ("ddp_sharded_fork", DDPShardedStrategy, "fork"),
        ("ddp_sharded_notebook", DDPShardedStrategy, "fork"),
        ("ddp_fully_sharded", DDPFullyShardedStrategy, "popen"),
        ("ddp_sharded_find_unused_parameters_false", DDPShardedStrategy, "popen"),
        ("ddp_sharded_spawn_find_unused_parameters_false", DDPSpawnShardedStrategy, "spawn"),
    ],
)
def test_registered_in_lightning(name: str, cls: type, start_method: str) -> None:
    strategy = StrategyRegistry.get(name)
    assert type(strategy) is cls
    assert strategy._start_method == start_method


def test_fsdp_name_is_left_to_lightning() -> None:
    assert "fsdp" not in STRATEGY_NAMES
    assert StrategyRegistry["fsdp"]["strategy"].__name__ == "FSDPStrategy"


def test_registration_is_idempotent_and_refuses_foreign_names() -> None:
    registry = _StrategyRegistry()
    assert register_fairscale_strategies(registry) == register_fairscale_strategies(registry)
    foreign = _StrategyRegistry()
    foreign.register("ddp_sharded", pl.strategies.DDPStrategy)
    with pytest.raises(ValueError, match="already registered for DDPStrategy"):
        register_fairscale_strategies(foreign)


# Lightning 1.x's registry test (pytorch_lightning/tests/strategies/test_registry.py), with
# our classes: a 1.x script that names these strategies runs unchanged.
@pytest.mark.parametrize(
    ("name", "cls", "init_params"),
    [
        (
            "ddp_sharded_spawn_find_unused_parameters_false",
            DDPSpawnShardedStrategy,
            {"find_unused_parameters": False},
        ),
        (
            "ddp_sharded_find_unused_parameters_false",
            DDPShardedStrategy,
            {"find_unused_parameters": False},
        ),
    ],
)
def test_lightning_1x_find_unused_parameters_false_names(
    tmp_path: Path, name: str, cls: type, init_params: dict[str, Any]
) -> None:
    trainer = pl.Trainer(
        default_root_dir=tmp_path, strategy=name, accelerator="cpu", devices=2, logger=False
    )
    assert isinstance(trainer.strategy, cls)
    assert name in StrategyRegistry
    assert StrategyRegistry[name]["init_params"] == init_params
    assert StrategyRegistry[name]["strategy"] == cls
    # 1.x passed find_unused_parameters=False explicitly, and its DDP keyword arguments showed
    # it; ShardedDDP itself gets its usual options (it never searches for unused parameters).
    assert trainer.strategy._ddp_kwargs == {"find_unused_parameters": False}
    assert trainer.strategy.sharded_ddp_options() == {"reduce_buffer_size": 0}


# Lightning 1.9.5's sharded-strategy tests (test_ddp_kwargs_from_registry,
# test_sharded_ddp_choice) and 1.8.6's connector test (multi-node GPUs, CUDA mocked), with
# our classes: each 1.x name builds the 1.x class, with the DDP keyword arguments 1.x gave.
_1X_NAMES = [
    ("ddp_sharded", DDPShardedStrategy, {}),
    (
        "ddp_sharded_find_unused_parameters_false",
        DDPShardedStrategy,
        {"find_unused_parameters": False},
    ),
    ("ddp_sharded_spawn", DDPSpawnShardedStrategy, {}),
    (
        "ddp_sharded_spawn_find_unused_parameters_false",
        DDPSpawnShardedStrategy,
        {"find_unused_parameters": False},
    ),
]


@pytest.mark.parametrize(("name", "cls", "ddp_kwargs"), _1X_NAMES)
def test_lightning_1x_names_build_the_1x_class_with_its_ddp_kwargs(
    tmp_path: Path, name: str, cls: type, ddp_kwargs: dict[str, Any]
) -> None:
    trainer = pl.Trainer(default_root_dir=tmp_path, fast_dev_run=True, strategy=name, logger=False)
    assert type(trainer.strategy) is cls
    assert trainer.strategy._ddp_kwargs == ddp_kwargs
    # Whatever the DDP keyword arguments, ShardedDDP gets only arguments it takes.
    assert trainer.strategy.sharded_ddp_options() == {"reduce_buffer_size": 0}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(("name", "cls", "ddp_kwargs"), _1X_NAMES)
def test_lightning_1x_names_on_several_gpu_nodes(
    name: str, cls: type, ddp_kwargs: dict[str, Any], devices: int
) -> None:
    from unittest import mock

    from pytorch_lightning.accelerators import CUDAAccelerator
    from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector

    with (
        mock.patch("lightning_fabric.accelerators.cuda.num_cuda_devices", return_value=2),
        mock.patch.object(CUDAAccelerator, "is_available", return_value=True),
        mock.patch("torch.cuda.is_available", return_value=True),
    ):
        connector = _AcceleratorConnector(
            num_nodes=2, accelerator="gpu", strategy=name, devices=devices
        )
    assert type(connector.strategy) is cls
    assert connector.strategy._ddp_kwargs == ddp_kwargs
    assert connector.strategy.sharded_ddp_options() == {"reduce_buffer_size": 2**23}


def test_ddp_spawn_sharded_strategy_is_the_spawn_variant_under_its_1x_name() -> None:
    strategy = DDPSpawnShardedStrategy(reduce_buffer_size=2**20)
    assert isinstance(strategy, DDPShardedStrategy)
    assert (strategy.strategy_name, strategy._start_method) == ("ddp_sharded_spawn", "spawn")
    assert strategy.sharded_ddp_kwargs == {"reduce_buffer_size": 2**20}
    trainer = pl.Trainer(strategy="ddp_sharded_spawn", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is DDPSpawnShardedStrategy
    with pytest.raises(ValueError, match="use DDPShardedStrategy"):
        DDPSpawnShardedStrategy(start_method="popen")


def test_find_unused_parameters_true_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="cannot look for unused.*ddp_find_unused_parameters_true"):
        DDPShardedStrategy(find_unused_parameters=True)


def test_trainer_accepts_the_string_name() -> None:
    trainer = pl.Trainer(
        strategy="ddp_sharded_notebook", accelerator="cpu", devices=2, logger=False
    )
    assert isinstance(trainer.strategy, DDPShardedStrategy)
    assert (
        trainer.strategy.launcher is not None
        and trainer.strategy.launcher.is_interactive_compatible
    )


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (DDPShardedStrategy, {"sharded_optimizer": []}, "unknown argument"),
        (DDPFullyShardedStrategy, {"offload": True}, r"unknown argument\(s\) \['offload'\]"),
        (DDPFullyShardedStrategy, {"move_params_to_cpu": True}, "unknown argument"),
        (DDPFullyShardedStrategy, {"activation_checkpointing": "Block"}, "nn.Module subclasses"),
        (DDPFullyShardedStrategy, {"activation_checkpointing": [nn.Linear, 3]}, "got 3"),
    ],
)
def test_bad_constructor_arguments(cls: type, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        cls(**kwargs)


def test_negative_min_num_params() -> None:
    with pytest.raises(ValueError, match="min_num_params must be >= 0"):
        DDPFullyShardedStrategy(min_num_params=-1)


def test_sharded_ddp_kwargs_are_kept() -> None:
    strategy = DDPShardedStrategy(reduce_buffer_size=0, broadcast_buffers=False)
    assert strategy.sharded_ddp_kwargs == {"reduce_buffer_size": 0, "broadcast_buffers": False}


@pytest.mark.parametrize(
    ("num_nodes", "kwargs", "expected"),
    [
        (1, {}, 0),  # Lightning 1.6-1.9: no reduce buckets on one node
        (2, {}, 2**23),  # buckets pay across nodes
        (2, {"reduce_buffer_size": 1024}, 1024),  # the user's value is kept
        (1, {"reduce_buffer_size": 2**20}, 2**20),
    ],
)
def test_reduce_buffer_size_defaults_as_in_lightning_1x(
    num_nodes: int, kwargs: dict[str, Any], expected: int
) -> None:
    strategy = DDPShardedStrategy(**kwargs)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=num_nodes, logger=False)
    assert strategy.num_nodes == num_nodes
    assert strategy.sharded_ddp_options()["reduce_buffer_size"] == expected
    assert strategy.sharded_ddp_kwargs == kwargs  # the user's arguments, unchanged


# Lightning turns "16-mixed" on CPU into "bf16-mixed" (with a warning) before the strategy
# sees it; "16-mixed" proper needs CUDA (test_strategies_gpu.py).
@pytest.mark.filterwarnings(
    "ignore:You passed `Trainer\\(accelerator='cpu', precision='16-mixed'\\)`"
)
@pytest.mark.parametrize(
    ("precision", "expected", "flag"),
    [
        ("32-true", ShardedPrecision, None),
        ("bf16-mixed", ShardedMixedPrecision, "bf16-mixed"),
        ("16-mixed", ShardedMixedPrecision, "bf16-mixed"),
    ],
)
def test_trainer_holds_the_shard_aware_precision_plugin_once_built(
    precision: str, expected: type, flag: str | None
) -> None:
    trainer = pl.Trainer(
        strategy="ddp_sharded_fork",
        accelerator="cpu",
        devices=2,
        precision=precision,  # type: ignore[arg-type]
        logger=False,
    )
    assert type(trainer.precision_plugin) is expected
    assert trainer.strategy.precision_plugin is trainer.precision_plugin
    if flag is not None:
        assert trainer.precision_plugin.precision == flag


def test_fully_sharded_strategy_makes_any_plugin_it_is_given_shard_aware() -> None:
    # Its Trainer needs CUDA; the connector assigns the plugin exactly like this.
    strategy = DDPFullyShardedStrategy()
    assert type(strategy.precision_plugin) is ShardedPrecision
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert type(strategy.precision_plugin) is ShardedMixedPrecision
    with pytest.raises(ValueError, match="use precision='32-true', 'bf16-mixed'"):
        strategy.precision_plugin = HalfPrecision("bf16-true")


def test_fully_sharded_defaults_follow_the_api_page() -> None:
    s = DDPFullyShardedStrategy()
    assert (s.cpu_offload, s.flatten_parameters, s.reshard_after_forward) == (False, True, True)
    assert (s.move_grads_to_cpu, s.fp32_reduce_scatter, s.compute_dtype) == (False, None, None)
    assert (s.bucket_cap_mb, s.min_num_params, s.state_dict_to_cpu) == (25, 100_000_000, True)
    assert DDPFullyShardedStrategy(cpu_offload=True).move_grads_to_cpu is True
    assert (
        DDPFullyShardedStrategy(cpu_offload=True, move_grads_to_cpu=False).move_grads_to_cpu
        is False
    )


@pytest.mark.parametrize("strategy", [DDPFullyShardedStrategy(), "ddp_fully_sharded"])
def test_fully_sharded_on_cpu_fails_when_the_trainer_is_created(strategy: object) -> None:
    with pytest.raises(ValueError, match=r"needs CUDA.*DDPShardedStrategy.*strategy='fsdp'"):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2)


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (Precision(), ShardedPrecision),
        (MixedPrecision("bf16-mixed", "cpu"), ShardedMixedPrecision),
        (ShardedPrecision(), ShardedPrecision),
    ],
)
def test_precision_is_made_shard_aware(plugin: Precision, expected: type) -> None:
    assert type(to_sharded_precision(plugin)) is expected


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_unsupported_precision_is_refused(precision: str) -> None:
    with pytest.raises(ValueError, match="use precision='32-true', 'bf16-mixed'"):
        to_sharded_precision(HalfPrecision(precision))  # type: ignore[arg-type]


def test_fp16_needs_cuda() -> None:
    with pytest.raises(ValueError, match="use precision='bf16-mixed' on CPU"):
        ShardedMixedPrecision("16-mixed", "cpu")


# Lightning 1.x's precision test (lightning-fairscale tests/test_sharded_precision.py): its
# plugin took 16, "bf16" and 32, and made a ShardedGradScaler for 16 only. (On a machine
# without CUDA the fp16 scaler is built disabled, with a warning.)
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    ("precision", "scaler", "expected"),
    [
        (16, torch.amp.GradScaler("cpu"), torch.amp.GradScaler),
        (16, None, "ShardedGradScaler"),
        ("bf16", None, None),
        (32, None, None),
    ],
)
def test_lightning_1x_precision_flags(precision: Any, scaler: Any, expected: Any) -> None:
    plugin = ShardedMixedPrecision(precision=precision, scaler=scaler, device="cuda")
    if expected is None:
        assert not plugin.scaler
    elif isinstance(expected, str):
        assert type(plugin.scaler).__name__ == expected
    else:
        assert isinstance(plugin.scaler, expected)


@pytest.mark.parametrize("precision", [32, "32", "32-true"])
def test_precision_32_casts_nothing(precision: Any) -> None:
    plugin = ShardedMixedPrecision(precision, "cpu")
    assert (plugin.precision, plugin.scaler) == ("32-true", None)
    layer = nn.Linear(4, 4)
    with plugin.forward_context():
        assert layer(torch.ones(2, 4)).dtype == torch.float32
    assert to_sharded_precision(plugin) is plugin
    with pytest.raises(ValueError, match="takes no scaler"):
        ShardedMixedPrecision(32, "cuda", scaler=torch.amp.GradScaler("cpu"))


def test_optimizer_without_sharded_params_names_the_fix() -> None:
    wrapped, module_params = nn.Linear(4, 4), nn.Linear(4, 4)
    good = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    bad = torch.optim.SGD(module_params.parameters(), lr=0.1)
    check_optimizers_use_sharded_params([good], wrapped, USE_TRAINER_MODEL)
    with pytest.raises(
        ValueError, match=r"optimizer 1 \(SGD\).*self\.trainer\.model\.parameters\(\)"
    ):
        check_optimizers_use_sharded_params([good, bad], wrapped, USE_TRAINER_MODEL)


@pytest.mark.parametrize(
    ("layers", "count"), [(nn.Linear, 2), ([nn.Linear, nn.ReLU], 3), ([], 0), (None, 0)]
)
def test_activation_checkpointing_wraps_the_given_layer_classes(layers: object, count: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    assert apply_activation_checkpointing(model, normalize_layer_classes(layers)) == count  # type: ignore[arg-type]
    wrapped = [m for m in model.modules() if "checkpointed" in str(getattr(m.forward, "func", ""))]
    assert len(wrapped) == count
    # Recomputing activations does not change gradients.
    model(x).sum().backward()
    for p, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, want)


def test_an_optimizer_holding_a_stale_tensor_besides_the_shards_is_refused() -> None:
    # Not only an optimizer with no shard at all: any tensor that is not a shard is stale.
    wrapped = nn.Linear(4, 4)
    mixed = torch.optim.SGD([*wrapped.parameters(), nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer 0 \(SGD\): .*not parameters of the model"):
        check_optimizers_use_sharded_params([mixed], wrapped, USE_TRAINER_MODEL)


def test_optimizers_for_parts_of_the_model_are_accepted() -> None:
    wrapped = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))  # a generator and a critic, say
    parts = [torch.optim.SGD(layer.parameters(), lr=0.1) for layer in wrapped]
    check_optimizers_use_sharded_params(parts, wrapped, USE_TRAINER_MODEL)


def test_activation_checkpointing_patches_each_outermost_layer_once() -> None:
    inner = nn.Sequential(nn.Linear(4, 4))
    model = nn.ModuleList([nn.Sequential(inner), nn.Linear(4, 1)])
    assert apply_activation_checkpointing(model, (nn.Sequential,)) == 1  # model[0], not inner
    assert apply_activation_checkpointing(model, (nn.Sequential,)) == 1  # already: left as is
    forward = model[0].forward
    assert "checkpointed" in str(forward) and "checkpointed" not in str(forward.args)  # type: ignore[attr-defined]
    assert "forward" not in inner.__dict__


def test_activation_checkpointing_of_a_class_the_model_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing=\[ReLU\]: no module"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), (nn.ReLU,))


def test_popen_switches_to_fork_in_an_interactive_session(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdp_guide.strategies._sharded as sharded_module

    monkeypatch.setattr(sharded_module, "_IS_INTERACTIVE", True)
    trainer = pl.Trainer(strategy="ddp_sharded", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy._start_method == "fork"  # type: ignore[attr-defined]

    monkeypatch.setattr(sharded_module, "_IS_INTERACTIVE", False)
    trainer = pl.Trainer(strategy="ddp_sharded", accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy._start_method == "popen"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("interactive", "given", "expected"),
    [(True, "popen", "fork"), (False, "popen", "popen"), (True, "spawn", "spawn")],
)
def test_fully_sharded_forks_in_an_interactive_session(
    monkeypatch: pytest.MonkeyPatch, interactive: bool, given: str, expected: str
) -> None:
    # The launcher is chosen without a GPU: the strategy is given a CUDA accelerator by hand.
    from lightning_fabric.plugins.environments import LightningEnvironment
    from pytorch_lightning.accelerators import CUDAAccelerator

    import fsdp_guide.strategies._fully_sharded as fully_sharded_module

    monkeypatch.setattr(fully_sharded_module, "_IS_INTERACTIVE", interactive)
    strategy = DDPFullyShardedStrategy(
        accelerator=CUDAAccelerator(),
        cluster_environment=LightningEnvironment(),
        start_method=given,  # type: ignore[arg-type]
    )
    strategy._configure_launcher()
    assert strategy._start_method == expected
    assert strategy.launcher is not None
    # What the Trainer checks in a notebook before it accepts a strategy.
    assert strategy.launcher.is_interactive_compatible is (expected == "fork")


# ("16-mixed" on CPU never reaches the strategy: Lightning turns it into "bf16-mixed".)
@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_bad_precision_fails_when_the_trainer_is_created(precision: str) -> None:
    # Before any rank starts, not in every rank's setup.
    with pytest.raises(ValueError, match="use precision='32-true', 'bf16-mixed'"):
        pl.Trainer(strategy="ddp_sharded_fork", accelerator="cpu", devices=2, precision=precision)  # type: ignore[arg-type]


class _GatherLikeFairScale(torch.nn.Module):
    """Stands in for a FairScale FSDP root: its gather mutates ``step`` like FairScale 0.4.13."""

    world_size = 2  # the gather runs only where FairScale shards

    def gather_full_optim_state_dict(self, optim: Any) -> dict[str, Any]:
        state = optim.state_dict()
        for per_param in state["state"].values():
            per_param["step"] = per_param["step"].item()
        return state


def test_saving_fully_sharded_optimizer_state_keeps_the_live_optimizer_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    strategy = DDPFullyShardedStrategy()
    monkeypatch.setattr(DDPFullyShardedStrategy, "_is_wrapped", lambda self: True)
    strategy.model = _GatherLikeFairScale()
    saved = strategy.optimizer_state(optimizer)
    assert all(isinstance(s["step"], float) for s in saved["state"].values())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # raised "state_steps ... singleton tensors" when the gather mutated it
    assert all(torch.equal(s["step"], torch.tensor(2.0)) for s in optimizer.state.values())
