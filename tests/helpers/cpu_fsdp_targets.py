"""Rank functions for the CPUFSDPStrategy tests: Lightning fits inside ranks started by launch.

Each rank builds its own ``Trainer`` (Lightning finds the process group already made, as
under torchrun) and trains the small transformer on its own slice of each global batch, so
a Lightning run and a plain FSDP1 run with the same settings see the same data and can be
compared step by step.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy
from strategy_helpers import SMALL_TRANSFORMER
from torch.distributed.fsdp import ShardingStrategy
from torch.utils.data import DataLoader, Dataset

from fsdp_guide.memory import measure_model_state
from fsdp_guide.models import Block, TinyTransformer, loss_fn, shard_batch, synthetic_batch
from fsdp_guide.strategies import CPUFSDPStrategy
from fsdp_guide.wrap import LayerPolicy, shard, sharded_units

STEPS = 3
LR = 1e-3


class StepBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """This rank's slice of the global batch of step ``i`` (4 sequences per step)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = synthetic_batch("transformer", 4, step=i, config=SMALL_TRANSFORMER)
        return shard_batch(batch, self.rank, self.world_size)


class LitSmall(pl.LightningModule):
    def __init__(self, manual_wrap: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyTransformer(SMALL_TRANSFORMER)
        self.manual_wrap = manual_wrap
        self.losses: list[float] = []
        self.state: dict[str, int] = {}

    def configure_model(self) -> None:
        if self.manual_wrap:
            from torch.distributed.fsdp.wrap import wrap

            for i, block in enumerate(self.model.blocks):
                self.model.blocks[i] = wrap(block)
            self.model = wrap(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = loss_fn(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)

    def on_train_end(self) -> None:
        state = measure_model_state(self.trainer.strategy.model, self.trainer.optimizers[0])
        self.state = state.as_dict()


class SaveAt(pl.Callback):
    """Save a checkpoint once the step ``step`` is done (every rank calls it)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fit(
    rank: int,
    world_size: int,
    strategy: pl.strategies.Strategy,
    *,
    manual_wrap: bool = False,
    max_steps: int = STEPS,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    callbacks: list[pl.Callback] | None = None,
) -> dict[str, Any]:
    """Fit the small transformer with ``strategy``; this rank's losses, state and units."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    lit = LitSmall(manual_wrap)
    loader = DataLoader(StepBatches(rank, world_size), batch_size=None)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    assert trainer.strategy.model is not None
    return {"losses": lit.losses, "state": lit.state, "units": sharded_units(lit.model)}


def plain(rank: int, world_size: int, sharding_strategy: str) -> dict[str, Any]:
    """The same training with PyTorch FSDP1 directly, with the settings Lightning uses."""
    torch.manual_seed(0)
    model = shard(
        TinyTransformer(SMALL_TRANSFORMER),
        engine="fsdp1",
        policy=LayerPolicy(Block),
        sharding_strategy=ShardingStrategy[sharding_strategy],
        use_orig_params=True,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    data = StepBatches(rank, world_size)
    losses = []
    for step in range(STEPS):
        loss = loss_fn(model, data[step])
        loss.backward()
        optimizer.step()
        if step < STEPS - 1:
            optimizer.zero_grad()
        losses.append(loss.item())
    state = measure_model_state(model, optimizer).as_dict()
    return {"losses": losses, "state": state, "units": sharded_units(model.module)}


SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def compare_with_plain(rank: int, world_size: int) -> dict[str, Any]:
    """Each sharding strategy through Lightning and through FSDP1 directly, on this rank."""
    _quiet()
    out: dict[str, Any] = {}
    for name in SHARDING:
        strategy = CPUFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=name)
        out[name] = {
            "lightning": fit(rank, world_size, strategy),
            "plain": plain(rank, world_size, name),
        }
    return out


def other_settings(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Hybrid sharding with a mesh tuple, manual wrapping, full and sharded checkpoints."""
    _quiet()
    out: dict[str, Any] = {}
    hybrid = CPUFSDPStrategy(
        auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", device_mesh=(1, world_size)
    )
    out["hybrid"] = fit(rank, world_size, hybrid)
    out["manual"] = fit(rank, world_size, CPUFSDPStrategy(), manual_wrap=True)
    # A checkpoint written at the end of the first epoch (by a callback: saved after fit()
    # stops at max_steps, Lightning would replay a batch); the resumed run's next epoch must
    # take the uninterrupted run's steps, optimizer state included.
    out["uninterrupted"] = fit(
        rank, world_size, CPUFSDPStrategy(auto_wrap_policy={Block}), max_steps=2 * STEPS
    )
    for kind in ("full", "sharded"):
        path = str(Path(root) / kind)
        options: dict[str, Any] = {"auto_wrap_policy": {Block}, "state_dict_type": kind}
        fit(rank, world_size, CPUFSDPStrategy(**options), callbacks=[SaveAt(STEPS, path)])
        out[f"resumed_{kind}"] = fit(
            rank, world_size, CPUFSDPStrategy(**options), max_steps=2 * STEPS, ckpt_path=path
        )
    return out


def bare_subclass(rank: int, world_size: int) -> str:
    """What Lightning's FSDPStrategy does on CPU ranks when the CPU check is passed."""
    _quiet()

    class Bare(FSDPStrategy):
        pass

    try:
        fit(rank, world_size, Bare(auto_wrap_policy={Block}))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"
