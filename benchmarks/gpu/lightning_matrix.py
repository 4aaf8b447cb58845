"""Step ``lightning``: ``DDPFullyShardedStrategy`` at ``devices=1``, each mode of seeds 000/002.

Auto wrap, manual wrap in ``configure_model``, ``cpu_offload``, activation checkpointing by
layer class, ``"16-mixed"`` with the sharded grad scaler, a checkpoint round trip, and the
seed's BoringModel example.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._checks import Checks, finite, max_rel_diff

# A model whose blocks (198,272 parameters each) auto-wrap at 100k.
MODEL = {"vocab_size": 256, "dim": 128, "n_heads": 4, "n_layers": 4, "seq_len": 32}
WRAP_MIN_PARAMS = 100_000
# 8 sequences in batches of 4: 2 batches an epoch, seen again every epoch, so the loss of
# the same batches can be compared from one epoch to the next.
SAMPLES = 8
BATCH = 4
STEPS = 8
# The round trip saves at the end of an epoch (a mid-epoch resume replays data otherwise).
SAVE_AT = 4
TABLE = "Lightning DDPFullyShardedStrategy, devices=1"


def lightning_matrix(work_dir: Path) -> int:
    """Train a TinyTransformer for a few steps in each mode of the strategy.

    The fp32 modes must give the losses of the same model trained unsharded
    (``strategy="auto"``) within 1e-4, the mixed-precision ones finite, decreasing losses.

    Args:
        work_dir: Where checkpoints are written.

    Returns:
        The exit status: 1 when a check failed.
    """
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.demos.boring_classes import BoringModel
    from torch.utils.data import DataLoader, TensorDataset

    from fsdp_guide.models import (
        Block,
        TinyTransformer,
        TransformerConfig,
        loss_fn,
        synthetic_batch,
    )
    from fsdp_guide.strategies import DDPFullyShardedStrategy, ShardedMixedPrecision
    from fsdp_guide.wrap import is_checkpointed

    checks = Checks("lightning")
    config = TransformerConfig(**MODEL)
    ckpt_dir = work_dir / "lightning"
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    class LitTransformer(pl.LightningModule):
        """The TinyTransformer; its optimizer is built from the (sharded) trainer.model."""

        def __init__(self, manual_wrap: bool = False) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyTransformer(config)
            self.manual_wrap = manual_wrap
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.manual_wrap:
                from fairscale.nn.wrap import wrap

                # Shards under DDPFullyShardedStrategy; a no-op under other strategies.
                for i, block in enumerate(self.model.blocks):
                    self.model.blocks[i] = wrap(block)

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(self.model, args[0])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            model = self.trainer.model  # the sharded model: the optimizer must see its shards
            assert model is not None
            return torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            tokens, targets = synthetic_batch("transformer", SAMPLES, config=config)
            return DataLoader(TensorDataset(tokens, targets), batch_size=BATCH)

    def fit(strategy: Any, module: pl.LightningModule, **options: Any) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        ckpt_path = options.pop("ckpt_path", None)
        settings: dict[str, Any] = {
            "accelerator": "gpu",
            "devices": 1,
            "max_steps": STEPS,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
        }
        torch.cuda.reset_peak_memory_stats()
        trainer = pl.Trainer(strategy=strategy, **{**settings, **options})
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer

    def sharded(trainer: pl.Trainer) -> torch.nn.Module:
        model = trainer.strategy.model
        assert model is not None
        return model

    def units(trainer: pl.Trainer) -> int:
        from fairscale.nn import FullyShardedDataParallel

        return sum(isinstance(m, FullyShardedDataParallel) for m in sharded(trainer).modules())

    def row(mode: str, losses: list[float], trainer: pl.Trainer | None) -> None:
        checks.table(
            TABLE,
            {
                "mode": mode,
                "steps": len(losses),
                "first loss": round(losses[0], 5) if losses else "",
                "last loss": round(losses[-1], 5) if losses else "",
                "FSDP units": units(trainer) if trainer is not None else "",
                "CUDA peak (MB)": round(torch.cuda.max_memory_allocated() / 1e6, 1),
            },
        )

    reference: list[float] = []

    def run_reference() -> None:
        module = LitTransformer()
        fit("auto", module)
        reference.extend(module.losses)
        checks.record("reference", finite(module.losses), f"unsharded losses {module.losses}")
        row("reference (strategy='auto')", module.losses, None)

    def decreasing(mode: str, losses: list[float]) -> None:
        # The last epoch's batches against the first epoch's (the same batches).
        per_epoch = SAMPLES // BATCH
        first, last = sum(losses[:per_epoch]), sum(losses[-per_epoch:])
        ok = finite(losses) and len(losses) > per_epoch and last < first
        checks.record(f"{mode}: finite, decreasing loss", ok, f"losses {losses}")

    def wrapped(mode: str, shown: str, manual: bool) -> None:
        module = LitTransformer(manual_wrap=manual)
        strategy = (
            DDPFullyShardedStrategy()
            if manual
            else DDPFullyShardedStrategy(min_num_params=WRAP_MIN_PARAMS)
        )
        trainer = fit(strategy, module)
        n = units(trainer)
        checks.record(f"{mode}: units", n == 1 + config.n_layers, f"{n} FSDP units")
        checks.close(f"{mode}: losses", module.losses, reference, 1e-4)
        row(shown, module.losses, trainer)

    def cpu_offload() -> None:
        module = LitTransformer()
        strategy = DDPFullyShardedStrategy(cpu_offload=True, min_num_params=WRAP_MIN_PARAMS)
        trainer = fit(strategy, module, precision="16-mixed")
        config_ok = strategy.fsdp_config()["move_params_to_cpu"] and strategy.move_grads_to_cpu
        devices = {p.device.type for p in sharded(trainer).parameters()}
        checks.record(
            "cpu_offload: shards on CPU", bool(config_ok) and devices == {"cpu"}, f"{devices}"
        )
        decreasing("cpu_offload", module.losses)
        row("cpu_offload=True, 16-mixed", module.losses, trainer)

    def activation_checkpointing() -> None:
        module = LitTransformer()
        strategy = DDPFullyShardedStrategy(
            min_num_params=WRAP_MIN_PARAMS, activation_checkpointing=[Block]
        )
        trainer = fit(strategy, module)
        done = sum(is_checkpointed(b) for b in module.model.modules() if isinstance(b, Block))
        checks.record(
            "activation_checkpointing: blocks", done == config.n_layers, f"{done} checkpointed"
        )
        checks.close("activation_checkpointing: losses", module.losses, reference, 1e-4)
        row("activation_checkpointing=[Block]", module.losses, trainer)

    def mixed_16() -> None:
        from fairscale.optim.grad_scaler import ShardedGradScaler

        module = LitTransformer()
        strategy = DDPFullyShardedStrategy(min_num_params=WRAP_MIN_PARAMS)
        trainer = fit(strategy, module, precision="16-mixed")
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        ok = type(plugin) is ShardedMixedPrecision and isinstance(scaler, ShardedGradScaler)
        checks.record(
            "16-mixed: sharded grad scaler", ok, f"{type(plugin).__name__}, {type(scaler).__name__}"
        )
        dtype = strategy.fsdp_config()["compute_dtype"]
        checks.record("16-mixed: fp16 compute", dtype == torch.float16, f"compute_dtype {dtype}")
        decreasing("16-mixed", module.losses)
        first = max_rel_diff(module.losses[:1], reference[:1])
        checks.record(
            "16-mixed: first loss near fp32's", first < 2e-2, f"relative difference {first:.2e}"
        )
        row('precision="16-mixed"', module.losses, trainer)

    def round_trip() -> None:
        ckpt = ckpt_dir / f"step{SAVE_AT}.ckpt"

        class SaveAt(pl.Callback):
            # Saved at an epoch's last batch: the resumed run starts at the next epoch.
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
                if trainer.global_step == SAVE_AT:
                    trainer.save_checkpoint(ckpt)

        def strategy() -> DDPFullyShardedStrategy:
            return DDPFullyShardedStrategy(min_num_params=WRAP_MIN_PARAMS)

        full = LitTransformer()
        fit(strategy(), full)
        fit(strategy(), LitTransformer(), max_steps=SAVE_AT, callbacks=[SaveAt()])
        saved = torch.load(ckpt, weights_only=False, map_location="cpu")
        names_ok = "model.blocks.0.fc1.weight" in saved["state_dict"]
        optim_ok = bool(saved["optimizer_states"][0]["state"])
        checks.record(
            "checkpoint: full names and optimizer state", names_ok and optim_ok, str(ckpt)
        )
        resumed = LitTransformer()
        trainer = fit(strategy(), resumed, ckpt_path=str(ckpt))
        checks.close(
            "checkpoint: resumed = uninterrupted", resumed.losses, full.losses[SAVE_AT:], 1e-5
        )
        row(f"checkpoint at step {SAVE_AT}, resumed", resumed.losses, trainer)

    def seed_example() -> None:
        class Boring(BoringModel):
            def configure_optimizers(self) -> Any:
                model = self.trainer.model
                assert model is not None
                return torch.optim.SGD(model.parameters(), lr=0.1)

        trainer = fit(DDPFullyShardedStrategy(), Boring(), precision=16, max_steps=2)
        checks.record(
            "seed example: BoringModel, precision=16",
            trainer.global_step == 2,
            f"{trainer.global_step} steps",
        )

    checks.guard("reference", run_reference)
    modes: list[tuple[str, Callable[[], None]]] = [
        ("auto_wrap", lambda: wrapped("auto_wrap", "auto wrap, min_num_params=100_000", False)),
        ("manual_wrap", lambda: wrapped("manual_wrap", "manual wrap in configure_model", True)),
        ("cpu_offload", cpu_offload),
        ("activation_checkpointing", activation_checkpointing),
        ("16-mixed", mixed_16),
        ("checkpoint", round_trip),
        ("seed_example", seed_example),
    ]
    for name, mode in modes:
        if name != "seed_example" and not reference:
            checks.skip(name, "no reference losses")
        else:
            checks.guard(name, mode)
    return checks.finish()
