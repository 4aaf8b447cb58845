"""``save(..., blocking=False)``: the state at the call is what loads, training goes on
meanwhile, and a rank killed while the background thread writes leaves the previous
checkpoint loadable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from practice_targets import async_save_then_train, tiny
from torch import nn

from fsdp_guide.checkpoint import load, save
from fsdp_guide.errors import RankError
from fsdp_guide.launcher import launch

pytestmark = pytest.mark.slow


def _loaded(path: Path) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    model = tiny()  # a sharded checkpoint of FSDP2 loads into the plain model too
    extra = load(path, model)
    return extra, {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("async") / "ckpt"
    runs = launch(async_save_then_train, world_size=2, args=(str(path), 1), timeout=300)
    return path, runs


def test_the_state_at_the_call_is_saved_while_training_goes_on(
    first: tuple[Path, list[dict[str, Any]]],
) -> None:
    path, runs = first
    extra, state = _loaded(path)
    assert extra == {"step": 1}
    assert _equal(state, runs[0]["at_call"])
    assert not _equal(state, runs[0]["after"])  # the step taken meanwhile is not in it


def test_the_staging_copy_is_the_ranks_state(first: tuple[Path, list[dict[str, Any]]]) -> None:
    _, runs = first
    # The rank's shards of parameters and Adam's moments and steps, copied to host memory.
    params = sum(p.numel() for p in tiny().parameters())
    assert all(r["staged"] >= 3 * 4 * params // 2 for r in runs)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(
    first: tuple[Path, list[dict[str, Any]]],
) -> None:
    path, runs = first
    before = json.loads((path / "index.json").read_text())
    with pytest.raises(RankError, match="SIGKILL"):
        launch(async_save_then_train, world_size=2, args=(str(path), 2, True), timeout=300)
    assert json.loads((path / "index.json").read_text()) == before
    attempts = [p.name for p in path.iterdir() if p.name.startswith("data-")]
    named = before["extra"].split("/")[0]
    # The killed save's directory, if its thread got as far as creating it, is named by
    # nothing: no load reads it, and the next save removes it.
    assert named in attempts and len(attempts) <= 2
    extra, state = _loaded(path)
    assert extra == {"step": 1} and _equal(state, runs[0]["at_call"])


@pytest.mark.parametrize(
    ("kind", "blocking", "match"),
    [
        ("sharded", False, "kind='sharded' is for strategies that shard"),
        ("full", False, "blocking=False writes each rank's shards in the background"),
        ("sharded", "no", "blocking must be True or False"),
    ],
)
def test_bad_background_saves_are_refused_before_writing(
    tmp_path: Path, kind: Any, blocking: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        save(tmp_path / "ckpt", nn.Linear(2, 2), kind=kind, blocking=blocking)
    assert not (tmp_path / "ckpt").exists()
