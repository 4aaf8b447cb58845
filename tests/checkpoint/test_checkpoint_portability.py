"""Checkpoints across world sizes and strategies: full files 2 -> 1 and 1 -> 2, consolidation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, differences, snapshot, train

from fsdp_guide import checkpoint, launch
from fsdp_guide.cli import main
from fsdp_guide.models import TinyTransformer

NAME_KEYED = ("module", "ddp", "fsdp1", "fsdp2")  # snapshot() keys their optimizer by name


def by_position(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state re-keyed by position in ``model.parameters()`` order."""
    from checkpoint_helpers import CONFIG

    names = [n for n, _ in TinyTransformer(CONFIG).named_parameters()]
    position = {n: i for i, n in enumerate(names)}
    return {
        "state": {position[n]: s for n, s in state["state"].items()},
        "param_groups": [
            {**g, "params": sorted(position[n] for n in g["params"])} for g in state["param_groups"]
        ],
    }


def train_and_save(rank: int, world_size: int, strategy: str, kind: str, path: str) -> Any:
    # One thread: GNU OpenMP deadlocks in a child forked after the parent (pytest, which runs
    # in-process tests here) used a thread pool; a lone forked rank would otherwise get 2.
    torch.set_num_threads(1)
    model, optimizer = build(strategy, seed=0)
    train(model, optimizer, start=0, steps=2)
    checkpoint.save(path, model, optimizer, kind=kind, extra={"step": 2})  # type: ignore[arg-type]
    return snapshot(model, optimizer, strategy)


def shared_state_tensors(optimizer: torch.optim.Optimizer) -> int:
    """How many of a plain optimizer's state tensors share storage with another one."""
    tensors = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return len(tensors) - len({t.untyped_storage().data_ptr() for t in tensors})


def load_and_compare(rank: int, world_size: int, strategy: str, path: str, expected: Any) -> Any:
    model, optimizer = build(strategy, seed=1)
    extra = checkpoint.load(path, model, optimizer)
    shared = shared_state_tensors(optimizer) if strategy == "module" else None
    loaded = snapshot(model, optimizer, strategy)
    if strategy not in NAME_KEYED:
        expected = {"model": expected["model"], "optimizer": by_position(expected["optimizer"])}
        if loaded["optimizer"] is None:  # consolidated on rank 0 only
            expected["optimizer"] = None
    return {"differences": differences(expected, loaded), "extra": extra, "shared": shared}


def file_content(path: Path) -> dict[str, Any]:
    """The checkpoint file read with torch alone, as a name-keyed snapshot."""
    payload = torch.load(path, weights_only=True)
    return {"model": payload["model"], "optimizer": payload["optimizer"]}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["ddp", "zero1", "oss", "fsdp1", "fsdp2"])
def test_full_checkpoint_from_two_ranks_loads_on_one(tmp_path: Path, source: str) -> None:
    path = tmp_path / "ckpt.pt"
    saved = launch(
        train_and_save, 2, args=(source, "full", str(path)), backend="gloo", start_method="fork"
    )
    result = load_and_compare(0, 1, "module", str(path), file_content(path))
    assert result["differences"] == []
    assert result["extra"] == {"step": 2}
    # FSDP1's full optimizer state shares one step tensor per flat parameter: a plain
    # optimizer sharing it would count every step several times.
    assert result["shared"] == 0
    if source in NAME_KEYED:  # the file holds exactly the state the ranks had
        assert differences(saved[0], file_content(path)) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", ["zero1", "sharded_ddp", "fsdp1", "fsdp2"])
def test_full_checkpoint_from_one_process_loads_on_two_ranks(tmp_path: Path, target: str) -> None:
    path = tmp_path / "ckpt.pt"
    saved = train_and_save(0, 1, "module", "full", str(path))
    results = launch(
        load_and_compare, 2, args=(target, str(path), saved), backend="gloo", start_method="fork"
    )
    for result in results:
        assert result["differences"] == []
        assert result["extra"] == {"step": 2}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["fsdp1", "fsdp2"])
def test_consolidated_two_rank_shards_load_in_one_process(
    tmp_path: Path, source: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sharded, full = tmp_path / "sharded", tmp_path / "full.pt"
    saved = launch(
        train_and_save,
        2,
        args=(source, "sharded", str(sharded)),
        backend="gloo",
        start_method="fork",
    )
    assert main(["consolidate", str(sharded), str(full)]) == 0
    assert f"consolidated 2 {source} shards" in capsys.readouterr().out
    result = load_and_compare(0, 1, "module", str(full), saved[0])
    assert result["differences"] == []
    assert result["extra"] == {"step": 2}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_consolidated_one_rank_shards_load_on_two_ranks(tmp_path: Path) -> None:
    sharded, full = tmp_path / "sharded", tmp_path / "full.pt"
    saved = launch(
        train_and_save,
        1,
        args=("fsdp2", "sharded", str(sharded)),
        backend="gloo",
        start_method="fork",
    )
    checkpoint.consolidate(sharded, full)
    results = launch(
        load_and_compare,
        2,
        args=("fsdp1", str(full), saved[0]),
        backend="gloo",
        start_method="fork",
    )
    assert [r["differences"] for r in results] == [[], []]


def test_consolidate_command_rejects_a_file_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "ckpt.pt"
    source.write_bytes(b"not a directory")
    assert main(["consolidate", str(source), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "is not a directory; consolidate takes a sharded checkpoint" in err[0]
    assert not (tmp_path / "out.pt").exists()


def save_with_one_load_with_other(
    rank: int, world_size: int, source: str, target: str, path: str
) -> Any:
    model, optimizer = build(source, seed=0)
    train(model, optimizer, start=0, steps=2)
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 2})
    saved = snapshot(model, optimizer, source)
    expected_losses = train(model, optimizer, start=2, steps=2)
    fresh, fresh_optimizer = build(target, seed=1)
    extra = checkpoint.load(path, fresh, fresh_optimizer)
    loaded = snapshot(fresh, fresh_optimizer, target)
    losses = train(fresh, fresh_optimizer, start=2, steps=2)
    return differences(saved, loaded), extra, losses == expected_losses


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("source", "target"), [("fsdp1", "fsdp2"), ("fsdp2", "fsdp1")])
def test_sharded_checkpoint_loads_across_pytorch_fsdp_versions(
    tmp_path: Path, source: str, target: str
) -> None:
    # load() accepts FSDP1 shards into FSDP2 and back: both split tensors along dim 0 alike.
    results = launch(
        save_with_one_load_with_other,
        2,
        args=(source, target, str(tmp_path / "ckpt")),
        backend="gloo",
        start_method="fork",
    )
    assert results == [([], {"step": 2}, True)] * 2
