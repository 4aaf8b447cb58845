"""CPUFSDPStrategy: Lightning's FSDPStrategy on CPU ranks, against Lightning and plain FSDP1.

Lightning refuses FSDP on a CPU accelerator, and a subclass that gets past that check fails
on every rank (what the teaching aid fixes, shown first). Then the strategy is compared with
PyTorch's FSDP1 run directly with the settings Lightning passes (``use_orig_params=True``, a
unit per ``Block``): the same units, the same losses, the same bytes on each rank. Ranks are
forked by ``fsdp_guide.launch``; each builds its own ``Trainer``, as under torchrun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cpu_fsdp_targets as targets
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy

from fsdp_guide import launch
from fsdp_guide.errors import EngineUnavailableError
from fsdp_guide.models import Block
from fsdp_guide.strategies import CPUFSDPStrategy

WORLD_SIZE = 2


def _launch(fn: Any, *args: Any) -> list[Any]:
    return launch(fn, WORLD_SIZE, args=args, backend="gloo", start_method="fork", timeout=240)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_cpu_offload", FSDPStrategy()], ids=str)
def test_lightning_refuses_its_fsdp_strategy_on_cpu(strategy: Any) -> None:
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


def test_a_subclass_passes_the_check() -> None:
    strategy = CPUFSDPStrategy(auto_wrap_policy={Block})
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy is strategy


def test_a_bare_subclass_fails_on_every_rank() -> None:
    # Lightning's own behaviour past the check: FSDP1 gets device_id=None on CPU.
    messages = _launch(targets.bare_subclass)
    assert all("FSDP needs a non-CPU accelerator device" in m for m in messages), messages


def test_cpu_offload_is_refused_before_any_rank_starts() -> None:
    strategy = CPUFSDPStrategy(cpu_offload=True)
    with pytest.raises(EngineUnavailableError, match="Leave cpu_offload unset on CPU"):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


@pytest.fixture(scope="module")
def compared() -> list[dict[str, Any]]:
    return _launch(targets.compare_with_plain)


@pytest.mark.parametrize("sharding", targets.SHARDING)
def test_trains_like_fsdp1_with_the_same_settings(
    compared: list[dict[str, Any]], sharding: str
) -> None:
    for rank in range(WORLD_SIZE):
        lightning, plain = compared[rank][sharding]["lightning"], compared[rank][sharding]["plain"]
        # Lightning's units are named from the LightningModule: model.blocks.0, ...
        units = {name.removeprefix("model."): unit for name, unit in lightning["units"].items()}
        assert units == plain["units"]
        assert lightning["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
        assert lightning["state"] == plain["state"]


def test_sharding_strategies_hold_what_they_should(compared: list[dict[str, Any]]) -> None:
    params = {name: compared[0][name]["lightning"]["state"]["params"] for name in targets.SHARDING}
    assert params["FULL_SHARD"] == params["SHARD_GRAD_OP"]  # both reshard after backward
    assert params["NO_SHARD"] == WORLD_SIZE * params["FULL_SHARD"]


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("cpu_fsdp")
    return _launch(targets.other_settings, str(root)), root


def test_hybrid_sharding_builds_its_mesh_on_cpu(
    others: tuple[list[dict[str, Any]], Path], compared: list[dict[str, Any]]
) -> None:
    # A (1, 2) mesh: one replica of two shards, which is FULL_SHARD.
    for rank in range(WORLD_SIZE):
        hybrid, full = others[0][rank]["hybrid"], compared[rank]["FULL_SHARD"]["lightning"]
        assert hybrid["losses"] == pytest.approx(full["losses"], rel=1e-6, abs=0)
        assert hybrid["state"] == full["state"]


def test_manual_wrap_in_configure_model(
    others: tuple[list[dict[str, Any]], Path], compared: list[dict[str, Any]]
) -> None:
    for rank in range(WORLD_SIZE):
        manual, auto = others[0][rank]["manual"], compared[rank]["FULL_SHARD"]["lightning"]
        assert sorted(manual["units"]) == ["", "blocks.0", "blocks.1"]
        assert manual["losses"] == pytest.approx(auto["losses"], rel=1e-6, abs=0)


def test_full_checkpoint_is_one_file_of_full_weights(
    others: tuple[list[dict[str, Any]], Path],
) -> None:
    results, root = others
    saved = torch.load(root / "full", weights_only=False)
    weights = saved["state_dict"]
    torch.manual_seed(0)
    reference = targets.TinyTransformer(targets.SMALL_TRANSFORMER).state_dict()
    assert {k.removeprefix("model.") for k in weights} == set(reference)
    assert all(weights[f"model.{k}"].shape == v.shape for k, v in reference.items())
    assert len(saved["optimizer_states"][0]["state"]) == len(reference)
    for rank in range(WORLD_SIZE):  # resumed from it: the uninterrupted run's second epoch
        resumed, whole = results[rank]["resumed_full"], results[rank]["uninterrupted"]
        assert len(resumed["losses"]) == targets.STEPS
        assert resumed["losses"] == pytest.approx(whole["losses"][targets.STEPS :], rel=1e-6, abs=0)


def test_sharded_checkpoint_is_a_file_per_rank(others: tuple[list[dict[str, Any]], Path]) -> None:
    results, root = others
    names = sorted(p.name for p in (root / "sharded").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    for rank in range(WORLD_SIZE):
        resumed, whole = results[rank]["resumed_sharded"], results[rank]["uninterrupted"]
        assert len(resumed["losses"]) == targets.STEPS
        assert resumed["losses"] == pytest.approx(whole["losses"][targets.STEPS :], rel=1e-6, abs=0)
