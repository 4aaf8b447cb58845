"""load_full_state_dict: full weights (torch file, safetensors, a full checkpoint) into shards."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import meta_build_targets as targets
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fsdp_guide import launch
from fsdp_guide.checkpoint import load_full_state_dict, read_full_state_dict, save
from fsdp_guide.errors import CheckpointError

WORLD_SIZE = 2


def weights(seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return targets.transformer().state_dict()


def write(path: Path, state: dict[str, torch.Tensor]) -> Path:
    if path.suffix == ".safetensors":
        save_file(state, path)
    elif path.name == "checkpoint.pt":
        model = targets.transformer()
        model.load_state_dict(state)
        save(path, model, kind="full")  # fsdp_guide's own full checkpoint
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize(
    ("name", "engine"),
    [("w.pt", "fsdp2"), ("w.safetensors", "fsdp2"), ("checkpoint.pt", "fsdp2"), ("w.pt", "fsdp1")],
)
def test_every_rank_gets_the_file_s_weights(tmp_path: Path, name: str, engine: str) -> None:
    source = weights()
    path = write(tmp_path / name, source)
    results = launch(
        targets.load_into, WORLD_SIZE, args=(str(path), engine), backend="gloo", start_method="fork"
    )
    whole = sum(t.numel() * t.element_size() for t in source.values())
    for rank, result in enumerate(results):
        assert result["weights"].keys() == source.keys()
        assert all(torch.equal(result["weights"][k], v) for k, v in source.items())
        assert result["summary"] == {"tensors": len(source), "bytes": whole}
        if rank > 0 and engine == "fsdp2":  # tensors come one by one, sliced as they come
            assert result["peak"] < whole / WORLD_SIZE


def _bad_shapes(tmp_path: Path) -> Path:
    state = weights()
    state["head.weight"] = torch.zeros(3, 3)
    return write(tmp_path / "bad.pt", state)


def _missing_key(tmp_path: Path) -> Path:
    state = weights()
    del state["ln_f.bias"]
    return write(tmp_path / "missing.safetensors", state)


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this ran while loading",))


def _code(tmp_path: Path) -> Path:
    path = tmp_path / "code.pt"
    torch.save({"head.weight": Payload()}, path, pickle_module=pickle)
    return path


def _truncated(tmp_path: Path) -> Path:
    path = write(tmp_path / "cut.pt", weights())
    path.write_bytes(path.read_bytes()[:1000])
    return path


def _flip_a_weight_byte(path: Path, weight: torch.Tensor) -> Path:
    """One bit of ``weight``'s bytes changed in the file (the zip still reads)."""
    raw = bytearray(path.read_bytes())
    raw[raw.index(weight.numpy().tobytes()[:64]) + 5] ^= 1
    path.write_bytes(bytes(raw))
    return path


def _flipped_full_checkpoint(tmp_path: Path) -> Path:
    state = weights()
    return _flip_a_weight_byte(write(tmp_path / "checkpoint.pt", state), state["head.weight"])


def _flipped_plain_file(tmp_path: Path) -> Path:
    state = weights()
    return _flip_a_weight_byte(write(tmp_path / "w.pt", state), state["head.weight"])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_bad_shapes, r"shapes differ \(head.weight: file \(3, 3\), model \(64, 32\)\)"),
        (_missing_key, r"missing 1 key\(s\), e.g. \['ln_f.bias'\]"),
        (_code, "pickled objects other than tensors"),
        (_truncated, "truncated"),
        (lambda tmp_path: tmp_path / "absent.pt", "does not exist"),
        (_flipped_full_checkpoint, "checkpoint.pt does not match the SHA-256 stored in it"),
        (_flipped_plain_file, r"w.pt does not match the CRC-32 of \S+/data/"),
    ],
    ids=["shapes", "missing", "code", "truncated", "absent", "flipped-full", "flipped-plain"],
)
def test_a_file_that_does_not_fit_is_refused_on_every_rank(
    tmp_path: Path, make: Any, message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    path = make(tmp_path)
    errors = launch(
        targets.load_refused, WORLD_SIZE, args=(str(path),), backend="gloo", start_method="fork"
    )
    assert len(errors) == WORLD_SIZE
    for error in errors:
        assert error != "loaded"
        assert re.search(message, error), error
    assert "this ran while loading" not in capfd.readouterr().out


def test_in_one_process_a_plain_module_loads_too(tmp_path: Path) -> None:
    path = write(tmp_path / "w.safetensors", weights(7))
    model = targets.transformer()
    assert load_full_state_dict(model, path)["tensors"] == len(weights())
    assert all(torch.equal(v, weights(7)[k]) for k, v in model.state_dict().items())


def test_a_training_checkpoint_is_not_a_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "train.pt"
    torch.save({"model": weights(), "step": 3}, path)
    with pytest.raises(CheckpointError, match="'model' is a OrderedDict, not a tensor"):
        read_full_state_dict(path)
    with pytest.raises(CheckpointError, match="rank 0 needs a source"):
        load_full_state_dict(nn.Linear(2, 2), None)


def test_a_full_checkpoint_without_a_digest_loads_with_a_warning(tmp_path: Path) -> None:
    path = write(tmp_path / "checkpoint.pt", weights(7))
    payload = torch.load(path, weights_only=True)
    torch.save(payload, path)  # the same checkpoint as an earlier fsdp_guide wrote it
    with pytest.warns(UserWarning, match="carries no SHA-256"):
        loaded = read_full_state_dict(path)
    assert all(torch.equal(v, weights(7)[k]) for k, v in loaded.items())
    torch.save(weights(7), path)  # a plain state dict: its CRC-32s suffice, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_full_state_dict(path)
