"""A checkpoint of one optimizer type loaded with another raises a CheckpointError naming both."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import CONFIG, build, differences, train
from torch import nn

from fsdp_guide import checkpoint, launch
from fsdp_guide.checkpoint import CheckpointError
from fsdp_guide.models import TinyTransformer

ADAMW_KEYS = r"\(exp_avg, exp_avg_sq, step\)"
SGD_KEYS = r"\(momentum_buffer\)"
OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}
# (saved with, loaded into, what the message says)
CASES = [
    (
        "AdamW",
        "SGD",
        rf"holds AdamW state {ADAMW_KEYS}, this optimizer is SGD, which keeps {SGD_KEYS}",
    ),
    (
        "SGD",
        "AdamW",
        rf"holds SGD state {SGD_KEYS}, this optimizer is AdamW, which keeps {ADAMW_KEYS}",
    ),
    # Same state keys, other update rule: Adam would silently take AdamW's hyperparameters.
    ("AdamW", "Adam", rf"holds AdamW state {ADAMW_KEYS}, this optimizer is Adam, which keeps"),
]
ADVICE = (
    r"Build the optimizer the checkpoint was saved with \((AdamW|SGD)\), or pass optimizer=None"
)


def trained(optimizer_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    train(model, optimizer, start=0, steps=1)
    return model, optimizer


@pytest.mark.parametrize(("saved_with", "loaded_into", "message"), CASES)
def test_full_checkpoint_into_another_optimizer_type(
    tmp_path: Path, saved_with: str, loaded_into: str, message: str
) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, *trained(saved_with))
    model = TinyTransformer(CONFIG)
    optimizer = OPTIMIZERS[loaded_into](model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{message}.*{ADVICE}"):
        checkpoint.load(path, model, optimizer)
    assert differences(before, dict(model.state_dict())) == []  # nothing loaded
    assert optimizer.state_dict()["state"] == {}
    assert checkpoint.load(path, model, None) is None  # the model alone still loads


def test_optimizer_type_check_reads_files_that_did_not_record_the_class(tmp_path: Path) -> None:
    # Full files of format 1 have no "optimizer_class": the state keys still tell.
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, *trained("AdamW"))
    payload = torch.load(path, weights_only=True)
    del payload["optimizer_class"]
    torch.save(payload, path)
    model = TinyTransformer(CONFIG)
    with pytest.raises(
        CheckpointError, match=rf"holds an optimizer state {ADAMW_KEYS}, this optimizer is SGD"
    ):
        checkpoint.load(path, model, OPTIMIZERS["SGD"](model.parameters()))


def save_then_load_into_sgd(rank: int, world_size: int, strategy: str, root: str) -> Any:
    model, optimizer = build(strategy, seed=0)  # AdamW
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(f"{root}/full.pt", model, optimizer, kind="full")
    checkpoint.save(f"{root}/sharded", model, optimizer, kind="sharded")
    errors = {}
    for kind, path in (("full", f"{root}/full.pt"), ("sharded", f"{root}/sharded")):
        fresh, _ = build(strategy, seed=1)
        sgd = torch.optim.SGD(fresh.parameters(), lr=1e-2, momentum=0.9)
        try:
            checkpoint.load(path, fresh, sgd)
            errors[kind] = "loaded"
        except Exception as exc:
            errors[kind] = f"{type(exc).__name__}: {exc}"
    return errors


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_fsdp_checkpoint_into_another_optimizer_type(tmp_path: Path, strategy: str) -> None:
    results = launch(
        save_then_load_into_sgd,
        2,
        args=(strategy, str(tmp_path)),
        backend="gloo",
        start_method="fork",
        timeout=100,
    )
    expected = rf"^CheckpointError: .*{CASES[0][2]}.*{ADVICE}"
    for rank, errors in enumerate(results):
        for kind in ("full", "sharded"):
            assert re.search(expected, errors[kind]), f"rank {rank}, {kind}: {errors[kind]}"
