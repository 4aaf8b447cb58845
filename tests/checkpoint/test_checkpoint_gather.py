"""Where a full checkpoint's state is gathered: ZeRO/OSS on every rank, FSDP on rank 0 only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, clone, count_tensors, differences, snapshot, train

from fsdp_guide import checkpoint, launch
from fsdp_guide.checkpoint._state import get_full_state
from fsdp_guide.engines import engine_for


def save_then_read_optimizer_on_each_rank(
    rank: int, world_size: int, strategy: str, path: str
) -> Any:
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(path, model, optimizer)
    # Right after save, with no consolidation of our own: FairScale's OSS must hold the
    # whole state on this rank (PyTorch's ZeRO allows state_dict() on one rank only).
    own = clone(optimizer.state_dict()) if strategy != "zero1" else None
    _, by_name = get_full_state(model, optimizer, strategy)  # type: ignore[arg-type]
    return {"state_dict": own, "by_name": clone(by_name)}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["zero1", "oss", "sharded_ddp"])
def test_sharded_optimizer_state_consolidated_on_every_rank_and_written_once(
    tmp_path: Path, strategy: str
) -> None:
    path = tmp_path / "ckpt.pt"
    ranks = launch(
        save_then_read_optimizer_on_each_rank,
        2,
        args=(strategy, str(path)),
        backend="gloo",
        start_method="fork",
        timeout=150,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # one file, no temporary
    written = torch.load(path, weights_only=True)["optimizer"]
    n_params = sum(1 for _ in build("module")[0].parameters())
    assert len(written["state"]) == n_params  # every rank's shard made it into the file
    for rank, result in enumerate(ranks):
        assert differences(written, result["by_name"]) == [], f"rank {rank}"
        if strategy != "zero1":
            assert len(result["state_dict"]["state"]) == n_params, f"rank {rank}"
            assert differences(ranks[0]["state_dict"], result["state_dict"]) == []


def gather_on_each_rank(rank: int, world_size: int, strategy: str) -> Any:
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, start=0, steps=1)
    reference = snapshot(model, optimizer, strategy)  # DCP's full state, on every rank
    model_state, optim_state = engine_for(model, optimizer).gather_to_rank0(model, optimizer)  # type: ignore[attr-defined]
    gathered = {"model": clone(model_state), "optimizer": clone(optim_state)}
    after = train(model, optimizer, start=1, steps=1)  # the gather left training intact
    return {
        "tensors": count_tensors(gathered),
        "reference_tensors": count_tensors(reference),
        "differences": differences(reference, gathered) if rank == 0 else None,
        "full_on_rank": get_full_state(model, optimizer, strategy)[0] is not None,  # type: ignore[arg-type]
        "next_loss": after,
    }


def train_only(rank: int, world_size: int, strategy: str) -> Any:
    model, optimizer = build(strategy, seed=0)
    return train(model, optimizer, start=0, steps=2)[1:]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_fsdp_full_state_is_gathered_on_rank_0_only(strategy: str) -> None:
    ranks = launch(gather_on_each_rank, 2, args=(strategy,), backend="gloo", start_method="fork")
    rank0, rank1 = ranks
    assert rank0["tensors"] == rank0["reference_tensors"] > 0
    assert rank0["differences"] == []
    assert rank1["tensors"] == 0  # rank 1 took part in the gathers but kept nothing
    assert [r["full_on_rank"] for r in ranks] == [True, False]
    uninterrupted = launch(train_only, 2, args=(strategy,), backend="gloo", start_method="fork")
    assert [r["next_loss"] for r in ranks] == uninterrupted


def adamw_after_one_step() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return layer, optimizer


def steps_to_floats(state: dict[str, Any]) -> None:
    """What FairScale FSDP's gather_full_optim_state_dict does to the dict it is given."""
    for per_param in state["state"].values():
        per_param["step"] = per_param["step"].item()


@pytest.mark.parametrize("protected", [True, False])
def test_fairscale_gather_cannot_break_the_live_optimizer(protected: bool) -> None:
    from fsdp_guide.engines.fairscale_fsdp import UnmutatedStateDict

    layer, optimizer = adamw_after_one_step()
    source: Any = UnmutatedStateDict(optimizer) if protected else optimizer
    steps_to_floats(source.state_dict())
    layer(torch.ones(1, 3)).sum().backward()
    if protected:
        optimizer.step()
        assert all(torch.equal(s["step"], torch.tensor(2.0)) for s in optimizer.state.values())
    else:  # the control: the failure the proxy prevents is real
        with pytest.raises(RuntimeError, match="state_steps"):
            optimizer.step()
