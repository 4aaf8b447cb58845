"""LightningModules and a runner shared by the strategy tests (CPU, 2 forked gloo ranks).

Ranks started by Lightning's fork launcher cannot hand Python objects back, so each module
writes what it observed (per-step losses, optimizer state bytes, accumulation flags) to a
JSON file per rank in a directory the test reads afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from fsdp_guide.memory import measure_model_state
from fsdp_guide.models import TinyTransformer, TransformerConfig, loss_fn, synthetic_batch

SMALL_TRANSFORMER = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)


def measured_model_state(trainer: pl.Trainer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, by fsdp_guide.memory.

    Call it right after the optimizer step (``on_train_batch_end``) and before the next
    ``zero_grad``, where :func:`~fsdp_guide.memory.measure_model_state` is meant to be used.
    For OSS it counts only this rank's shard of the optimizer state.
    """
    optimizer = trainer.optimizers[0]
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    assert trainer.strategy.model is not None
    state = measure_model_state(trainer.strategy.model, optimizer)
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer}


def global_grad_norm(optimizer: Any) -> float:
    """The L2 norm of all gradients across ranks (a collective for OSS), without clipping."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if hasattr(optimizer, "clip_grad_norm"):  # OSS: each rank holds its shard's reduced grads
        return float(optimizer.clip_grad_norm(float("inf")))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return float(torch.nn.utils.clip_grad_norm_(params, float("inf")))


class RecorderMixin:
    """Records losses and diagnostics; writes them to ``out_dir/rank<N>.json`` at the end."""

    out_dir: Path
    record: dict[str, list[Any]]

    def init_recorder(self, out_dir: Path | str) -> None:
        self.out_dir = Path(out_dir)
        self.record = {
            "loss": [],
            "accumulating": [],
            "lr": [],
            "norm_before": [],
            "norm_after": [],
        }

    def remember_loss(self, loss: Tensor) -> None:
        self.record["loss"].append(float(loss.detach()))

    def on_before_backward(self, loss: Tensor) -> None:
        model = self.trainer.strategy.model  # type: ignore[attr-defined]
        self.record["accumulating"].append(getattr(model, "_should_accumulate_grads", None))

    def on_train_batch_end(self, *args: Any) -> None:
        trainer = self.trainer  # type: ignore[attr-defined]
        self.record["lr"].append(trainer.optimizers[0].param_groups[0]["lr"])
        # After this step's optimizer.step(), before the next zero_grad: the last step's is kept.
        self.record["model_state"] = [measured_model_state(trainer)]

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.record["norm_before"].append(global_grad_norm(optimizer))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[attr-defined]
        self.record["norm_after"].append(global_grad_norm(optimizer))

    def on_train_end(self) -> None:
        trainer = self.trainer  # type: ignore[attr-defined]
        self.record["optimizer_type"] = [type(trainer.optimizers[0]).__name__]
        self.record["model_type"] = [type(trainer.strategy.model).__name__]
        self.record["uses_buckets"] = [getattr(trainer.strategy.model, "_use_buckets", None)]
        self.write_record()

    def write_record(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank{self.trainer.global_rank}.json"  # type: ignore[attr-defined]
        path.write_text(json.dumps(self.record))


class RecordingBoringModel(RecorderMixin, BoringModel):
    """Lightning's BoringModel trained with Adam + StepLR, recording its losses."""

    def __init__(self, out_dir: Path | str) -> None:
        torch.manual_seed(0)  # same initial weights for every strategy compared
        super().__init__()
        self.init_recorder(out_dir)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.remember_loss(out["loss"])
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class TokenDataset(Dataset[tuple[Tensor, Tensor]]):
    """Seeded token sequences for the small transformer."""

    def __init__(self, n: int = 32) -> None:
        self.tokens, self.targets = synthetic_batch("transformer", n, config=SMALL_TRANSFORMER)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.tokens[i], self.targets[i]


class RecordingTransformer(RecorderMixin, pl.LightningModule):
    """fsdp_guide's TinyTransformer (small config) as a LightningModule."""

    def __init__(self, out_dir: Path | str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer(SMALL_TRANSFORMER)
        self.init_recorder(out_dir)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = loss_fn(self.model, batch)
        self.remember_loss(loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(
            [
                {"params": self.model.blocks.parameters(), "lr": 3e-3},
                {"params": [p for n, p in self.model.named_parameters() if "blocks" not in n]},
            ],
            lr=1e-3,
            weight_decay=0.01,
        )

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return DataLoader(TokenDataset(), batch_size=4)


def fit(
    strategy: Any, model: pl.LightningModule, ckpt_path: str | None = None, **trainer_kwargs: Any
) -> pl.Trainer:
    """Fit on 2 CPU ranks with everything not under test switched off."""
    pl.seed_everything(0, verbose=False)
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 4,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(trainer_kwargs)
    trainer = pl.Trainer(strategy=strategy, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def read_records(out_dir: Path, world_size: int = 2) -> list[dict[str, list[Any]]]:
    """The JSON records of every rank, ordered by rank."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
