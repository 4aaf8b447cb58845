"""DDPShardedStrategy on 2 CPU gloo ranks against Lightning's plain DDP, plus error cases.

Ranks are forked by Lightning's own launcher (``start_method="fork"``); every module writes
its per-step losses to ``tmp_path`` (see ``strategy_helpers``), which the test compares.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from strategy_helpers import (
    SMALL_TRANSFORMER,
    RecordingBoringModel,
    RecordingTransformer,
    fit,
    read_records,
)

from fsdp_guide.memory import estimate_model_state
from fsdp_guide.models import TinyTransformer, count_params
from fsdp_guide.strategies import DDPShardedStrategy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def sharded() -> DDPShardedStrategy:
    return DDPShardedStrategy(start_method="fork")


def plain_ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork")


def assert_losses_close(a: list[float], b: list[float], rtol: float) -> None:
    assert len(a) == len(b) > 0
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert math.isclose(x, y, rel_tol=rtol), f"step {step}: {x} != {y}"


def assert_same_state(got: Any, want: Any) -> None:
    """Nested optimizer states are equal: same keys, equal tensors, equal other values."""
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same_state(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_state(g, w)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize(
    ("module_cls", "sharded_ddp_kwargs", "buckets"),
    [
        # One node: no reduce buckets by default, one reduce per gradient (Lightning 1.6-1.9).
        (RecordingBoringModel, {}, False),
        (RecordingTransformer, {}, False),
        # Extra arguments reach ShardedDataParallel: a bucket size given is used.
        (RecordingTransformer, {"reduce_buffer_size": 2**20}, True),
    ],
)
def test_sharded_matches_plain_ddp_per_step(
    tmp_path: Path, module_cls: Any, sharded_ddp_kwargs: dict[str, Any], buckets: bool
) -> None:
    strategy = DDPShardedStrategy(start_method="fork", **sharded_ddp_kwargs)
    fit(strategy, module_cls(tmp_path / "sharded"), max_steps=5)
    fit(plain_ddp(), module_cls(tmp_path / "ddp"), max_steps=5)
    got, want = read_records(tmp_path / "sharded"), read_records(tmp_path / "ddp")
    for rank in range(2):
        assert got[rank]["optimizer_type"] == ["OSS"]
        assert got[rank]["model_type"] == ["ShardedDataParallel"]
        assert got[rank]["uses_buckets"] == [buckets]
        assert want[rank]["model_type"] == ["DistributedDataParallel"]
        assert_losses_close(got[rank]["loss"], want[rank]["loss"], rtol=1e-5)
        # The LR scheduler follows the rebuilt optimizer.
        assert got[rank]["lr"] == want[rank]["lr"]
    # Training moved: the losses are not a constant sequence.
    assert len(set(got[0]["loss"])) > 1


def test_each_rank_holds_only_its_optimizer_shard(tmp_path: Path) -> None:
    fit(sharded(), RecordingTransformer(tmp_path / "sharded"), max_steps=1)
    fit(plain_ddp(), RecordingTransformer(tmp_path / "ddp"), max_steps=1)
    # Measured with fsdp_guide.memory after the step, on each rank.
    sharded_states = [r["model_state"][0] for r in read_records(tmp_path / "sharded")]
    ddp_states = [r["model_state"][0] for r in read_records(tmp_path / "ddp")]
    model = TinyTransformer(SMALL_TRANSFORMER)
    num_params, num_tensors = count_params(model), len(list(model.parameters()))
    # AdamW keeps exp_avg and exp_avg_sq (ZeRO's K = 8 bytes per fp32 parameter) plus a
    # 4-byte step per parameter tensor, which the ZeRO formula leaves out.
    full = estimate_model_state(num_params, 1, "ddp").optimizer + 4 * num_tensors
    assert [s["optimizer"] for s in ddp_states] == [full, full]
    shards = [s["optimizer"] for s in sharded_states]
    # Each rank holds only its shard: together exactly the full state, none of it twice...
    assert sum(shards) == full
    # ...and each within 5% of ZeRO-1's prediction for 2 ranks (OSS balances whole tensors).
    per_rank = estimate_model_state(num_params, 2, "oss").optimizer
    assert all(abs(shard - per_rank) < 0.05 * per_rank for shard in shards), (shards, per_rank)
    # Parameters are not sharded by OSS + ShardedDDP: the full model on every rank.
    assert [s["params"] for s in sharded_states] == [4 * num_params] * 2


def test_accumulation_skips_reduction_and_clipping_uses_the_global_norm(tmp_path: Path) -> None:
    clip = 0.05
    options = {"max_steps": 3, "accumulate_grad_batches": 2, "gradient_clip_val": clip}
    fit(sharded(), RecordingTransformer(tmp_path / "sharded"), **options)
    fit(plain_ddp(), RecordingTransformer(tmp_path / "ddp"), **options)
    got, want = read_records(tmp_path / "sharded"), read_records(tmp_path / "ddp")
    for rank in range(2):
        # ShardedDDP accumulates locally on every first micro-batch of a step.
        assert got[rank]["accumulating"] == [True, False] * 3
        assert_losses_close(got[rank]["loss"], want[rank]["loss"], rtol=1e-5)
        # Clipping was active and brought the norm over all shards down to the threshold,
        # as plain DDP does over the full gradients.
        assert all(norm > 2 * clip for norm in got[rank]["norm_before"])
        assert_losses_close(got[rank]["norm_before"], want[rank]["norm_before"], rtol=1e-4)
        assert_losses_close(got[rank]["norm_after"], [clip] * 3, rtol=1e-3)
        assert_losses_close(want[rank]["norm_after"], [clip] * 3, rtol=1e-3)


def test_bf16_mixed_on_cpu_matches_plain_ddp(tmp_path: Path) -> None:
    fit(sharded(), RecordingTransformer(tmp_path / "sharded"), max_steps=3, precision="bf16-mixed")
    fit(plain_ddp(), RecordingTransformer(tmp_path / "ddp"), max_steps=3, precision="bf16-mixed")
    got, want = read_records(tmp_path / "sharded"), read_records(tmp_path / "ddp")
    for rank in range(2):
        assert_losses_close(got[rank]["loss"], want[rank]["loss"], rtol=1e-3)


def test_save_then_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "step3.ckpt"

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                # What each rank gets from the strategy (a collective, like the save).
                state = trainer.strategy.optimizer_state(trainer.optimizers[0])
                torch.save(state, tmp_path / f"optimizer_state_rank{trainer.global_rank}.pt")
                trainer.save_checkpoint(ckpt)  # collective: every rank calls it

    # Epochs of 3 steps: the checkpoint falls on an epoch boundary, where Lightning resumes
    # with the next epoch's first batch (mid-epoch it would restart the data).
    options: dict[str, Any] = {"limit_train_batches": 3}
    fit(sharded(), RecordingBoringModel(tmp_path / "full"), max_steps=6, **options)
    fit(
        sharded(),
        RecordingBoringModel(tmp_path / "first"),
        max_steps=3,
        callbacks=[SaveAt()],
        **options,
    )
    saved = torch.load(ckpt, weights_only=False)
    # Consolidated: one full Adam state (both parameters), written once (by rank 0)...
    written = saved["optimizer_states"][0]
    assert len(written["state"]) == 2
    assert {name for name in written["state"][0]} == {"step", "exp_avg", "exp_avg_sq"}
    # ...and materialised in full, the same, on every rank.
    for rank in range(2):
        state = torch.load(tmp_path / f"optimizer_state_rank{rank}.pt", weights_only=False)
        assert_same_state(state, written)
    fit(
        sharded(),
        RecordingBoringModel(tmp_path / "resumed"),
        max_steps=6,
        ckpt_path=str(ckpt),
        **options,
    )
    full, first, resumed = (read_records(tmp_path / d) for d in ("full", "first", "resumed"))
    for rank in range(2):
        assert first[rank]["loss"] == full[rank]["loss"][:3]
        assert_losses_close(resumed[rank]["loss"], full[rank]["loss"][3:], rtol=1e-6)
        assert resumed[rank]["lr"] == full[rank]["lr"][3:]


class UnwrappedProbe(RecordingBoringModel):
    """Records the strategy's model type in every evaluation loop."""

    def probe(self) -> None:
        self.record["model_type"] = [type(self.trainer.strategy.model).__name__]
        self.write_record()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.probe()
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        self.probe()
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.probe()
        return super().predict_step(batch, batch_idx, dataloader_idx)


@pytest.mark.parametrize("loop", ["validate", "test", "predict"])
def test_evaluation_loops_run_unwrapped(tmp_path: Path, loop: str) -> None:
    trainer = pl.Trainer(
        strategy=sharded(),
        accelerator="cpu",
        devices=2,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run = getattr(trainer, loop)
    if loop == "predict":
        run(UnwrappedProbe(tmp_path))
    else:
        run(UnwrappedProbe(tmp_path), verbose=False)
    records = read_records(tmp_path)
    assert [r["model_type"] for r in records] == [["UnwrappedProbe"], ["UnwrappedProbe"]]


def test_popen_launcher_trains_boring_model_from_a_script(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import pytorch_lightning as pl\n"
        "from pytorch_lightning.demos.boring_classes import BoringModel\n"
        "from fsdp_guide.strategies import DDPShardedStrategy\n"
        "trainer = pl.Trainer(strategy=DDPShardedStrategy(), accelerator='cpu', devices=2,\n"
        "    max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,\n"
        "    enable_model_summary=False, limit_val_batches=0)\n"
        "trainer.fit(BoringModel())\n"
        "import sys\n"
        "name = type(trainer.optimizers[0]).__name__\n"
        "# One write per rank: both ranks share this stdout, separate writes can interleave.\n"
        "sys.stdout.write(f'RANK {trainer.global_rank} STEPS {trainer.global_step} {name}\\n')\n"
        "sys.stdout.flush()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "helpers")}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RANK 0 STEPS 2 OSS" in done.stdout
    assert "RANK 1 STEPS 2 OSS" in done.stdout


def test_spawn_variant_trains_and_returns_rank_zero_weights(tmp_path: Path) -> None:
    # "ddp_sharded_spawn" re-imports torch, Lightning and FairScale in each rank: one short run.
    module = RecordingBoringModel(tmp_path)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fit("ddp_sharded_spawn", module, max_steps=2)
    assert isinstance(trainer.strategy, DDPShardedStrategy)
    assert trainer.strategy._start_method == "spawn"
    records = read_records(tmp_path)
    assert [r["optimizer_type"] for r in records] == [["OSS"], ["OSS"]]
    assert [len(r["loss"]) for r in records] == [2, 2]
    # Spawned ranks hand rank 0's trained weights back to this process.
    assert any(not torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
