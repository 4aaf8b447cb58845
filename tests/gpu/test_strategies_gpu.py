"""DDPFullyShardedStrategy (FairScale FSDP) on one CUDA GPU: world size 1, NCCL, in-process.

FairScale's FSDP is CUDA-only, so every test here is ``gpu``-marked and skipped on CPU. With
one device Lightning runs the rank in the test process, so recorded losses are read directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.demos.boring_classes import BoringModel
from strategy_helpers import SMALL_TRANSFORMER, TokenDataset
from torch import Tensor, nn
from torch.utils.data import DataLoader

from fsdp_guide.models import Block, TinyTransformer, loss_fn
from fsdp_guide.strategies import DDPFullyShardedStrategy

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]


class FSDPTransformer(pl.LightningModule):
    """TinyTransformer whose optimizer is built from the (sharded) trainer.model."""

    def __init__(self, use_own_params: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer(SMALL_TRANSFORMER)
        self.use_own_params = use_own_params
        self.losses: list[float] = []

    def wrap_blocks(self) -> None:
        from fairscale.nn.wrap import wrap

        # Shards under DDPFullyShardedStrategy; returns the block unchanged elsewhere.
        for i, block in enumerate(self.model.blocks):
            self.model.blocks[i] = wrap(block)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = loss_fn(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        params = self.parameters() if self.use_own_params else self.trainer.model.parameters()
        return torch.optim.AdamW(params, lr=1e-3)

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(TokenDataset(), batch_size=4)


class ManualWrap(FSDPTransformer):
    def configure_model(self) -> None:
        self.wrap_blocks()


class LegacyManualWrap(FSDPTransformer):
    """The same wrapping in the deprecated hook that the seeds use."""

    def configure_sharded_model(self) -> None:
        self.wrap_blocks()


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    # Lightning initialises a process group in this process even for one device and leaves
    # it up after fit; a later test's launch() would then refuse to start its ranks.
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train(strategy: Any, module: pl.LightningModule, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    options: dict[str, Any] = {
        "accelerator": "gpu",
        "devices": 1,
        # Under any distributed strategy (world size 1 too) Lightning swaps the training
        # loader's sampler for a DistributedSampler that shuffles, while the single-device
        # reference reads in order: the runs compared would see other batches from step 1.
        "use_distributed_sampler": False,
        "max_steps": 4,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    ckpt_path = kwargs.pop("ckpt_path", None)
    options.update(kwargs)
    trainer = pl.Trainer(strategy=strategy, **options)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def fsdp_modules(model: nn.Module) -> int:
    from fairscale.nn import FullyShardedDataParallel

    return sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def assert_close(a: list[float], b: list[float], rtol: float) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=rtol), (a, b)


def reference_losses() -> list[float]:
    reference = FSDPTransformer(use_own_params=True)
    train("auto", reference)
    return reference.losses


def test_auto_wrap_trains_like_a_single_device_run(tmp_path: Path) -> None:
    module = FSDPTransformer()
    trainer = train(DDPFullyShardedStrategy(min_num_params=10_000), module)
    # Each block (about 12.7k parameters) got its own wrapper, plus the root.
    assert fsdp_modules(trainer.strategy.model) == 1 + SMALL_TRANSFORMER.n_layers
    assert_close(module.losses, reference_losses(), rtol=1e-4)
    # Teardown left the shards on the GPU, so the model can still be gathered and saved.
    assert {p.device.type for p in trainer.strategy.model.parameters()} == {"cuda"}
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    saved = torch.load(tmp_path / "after_fit.ckpt", weights_only=False)
    assert "model.blocks.0.fc1.weight" in saved["state_dict"]


def test_cpu_offload_keeps_parameter_shards_on_cpu() -> None:
    module = FSDPTransformer()
    strategy = DDPFullyShardedStrategy(cpu_offload=True, min_num_params=10_000)
    trainer = train(strategy, module, precision="16-mixed")
    assert strategy.fsdp_config()["move_params_to_cpu"] and strategy.move_grads_to_cpu
    assert {p.device.type for p in trainer.strategy.model.parameters()} == {"cpu"}
    # fp16 compute against the fp32 single-device run (the loss does not fall every step).
    assert_close(module.losses, reference_losses(), rtol=1e-2)


@pytest.mark.parametrize("module_cls", [ManualWrap, LegacyManualWrap])
def test_manual_wrap_in_configure_model(module_cls: type[FSDPTransformer]) -> None:
    module = module_cls()
    # min_num_params so large that auto-wrap alone would wrap only the root.
    trainer = train(DDPFullyShardedStrategy(), module)
    assert fsdp_modules(trainer.strategy.model) == 1 + SMALL_TRANSFORMER.n_layers
    assert_close(module.losses, reference_losses(), rtol=1e-4)
    # Under another strategy the same hook leaves the blocks alone.
    plain = module_cls(use_own_params=True)
    train("auto", plain, max_steps=1)
    assert all(type(b) is Block for b in plain.model.blocks)


def test_activation_checkpointing_by_layer_class() -> None:
    module = FSDPTransformer()
    strategy = DDPFullyShardedStrategy(min_num_params=10_000, activation_checkpointing=[Block])
    train(strategy, module)
    patched = [b for b in module.model.modules() if isinstance(b, Block)]
    assert patched and all("checkpointed" in str(b.forward) for b in patched)
    assert_close(module.losses, reference_losses(), rtol=1e-4)


def test_checkpoint_round_trip_resumes_like_an_uninterrupted_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "step3.ckpt"

    class SaveAt(pl.Callback):
        # Saved from the last batch of epoch 0: Lightning then resumes at epoch 1's first
        # batch (a checkpoint saved in on_train_epoch_end would replay data differently).
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.save_checkpoint(ckpt)

    options: dict[str, Any] = {"limit_train_batches": 3}
    full = FSDPTransformer()
    train(DDPFullyShardedStrategy(min_num_params=10_000), full, max_steps=6, **options)
    first = FSDPTransformer()
    train(
        DDPFullyShardedStrategy(min_num_params=10_000),
        first,
        max_steps=3,
        callbacks=[SaveAt()],
        **options,
    )
    saved = torch.load(ckpt, weights_only=False)
    assert "model.blocks.0.fc1.weight" in saved["state_dict"]  # full, unflattened names
    assert saved["optimizer_states"][0]["state"]
    resumed = FSDPTransformer()
    strategy = DDPFullyShardedStrategy(min_num_params=10_000)
    train(strategy, resumed, max_steps=6, ckpt_path=str(ckpt), **options)
    assert_close(resumed.losses, full.losses[3:], rtol=1e-5)


@pytest.mark.parametrize(
    ("min_num_params", "match"),
    [
        (100_000_000, "empty parameter list"),  # only the root wrapped: self.parameters() is empty
        (10_000, "miss 1 sharded parameter"),  # blocks wrapped: the root's shard would be missed
    ],
)
def test_optimizer_on_unsharded_params_names_the_fix(min_num_params: int, match: str) -> None:
    strategy = DDPFullyShardedStrategy(min_num_params=min_num_params)
    with pytest.raises(
        ValueError,
        match=rf"self\.trainer\.model\.parameters\(\).*{match}|{match}.*self\.trainer\.model",
    ):
        train(strategy, FSDPTransformer(use_own_params=True), max_steps=1)


def test_seed_example_boring_model_fp16() -> None:
    class Boring(BoringModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.trainer.model.parameters(), lr=0.1)

    trainer = train(DDPFullyShardedStrategy(), Boring(), precision="16-mixed", max_steps=2)
    assert trainer.global_step == 2


def test_sharded_strategy_fp16_uses_the_sharded_grad_scaler() -> None:
    from fairscale.optim.grad_scaler import ShardedGradScaler

    from fsdp_guide.strategies import DDPShardedStrategy

    module = FSDPTransformer(use_own_params=True)
    trainer = train(DDPShardedStrategy(), module, precision="16-mixed", gradient_clip_val=1.0)
    assert isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)  # type: ignore[attr-defined]
    assert type(trainer.optimizers[0]).__name__ == "OSS"
    assert all(math.isfinite(x) for x in module.losses)
    fp32 = FSDPTransformer(use_own_params=True)
    train(DDPShardedStrategy(), fp32)
    assert_close(fp32.losses, reference_losses(), rtol=1e-4)


@pytest.mark.parametrize("strategy", ["ddp_sharded_fork", "ddp_fully_sharded"])
def test_16_mixed_gets_the_sharded_grad_scaler_when_the_trainer_is_built(strategy: str) -> None:
    from fairscale.optim.grad_scaler import ShardedGradScaler

    from fsdp_guide.strategies import ShardedMixedPrecision

    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="16-mixed", logger=False
    )
    assert type(trainer.precision_plugin) is ShardedMixedPrecision
    assert isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)
