"""A full checkpoint whose bytes changed after saving is refused, tensor data included.

``torch.load`` checks none of the CRC-32s of the zip archive ``torch.save`` writes, so one
flipped bit in a weight loaded silently. Every member of the archive is flipped in turn
below (each tensor storage, the pickled structure, torch's own records, the digest itself):
each must raise :class:`CheckpointError` naming the file, on one rank and on every rank of
two. A file written before the digest existed is checked against its CRC-32s instead.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, train

from fsdp_guide import checkpoint, launch
from fsdp_guide.checkpoint import CheckpointError
from fsdp_guide.checkpoint._io import FULL_FORMAT


def members(path: Path) -> dict[str, tuple[int, int]]:
    """Each member of the zip archive with the offset and size of its bytes."""
    with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
        out = {}
        for info in archive.infolist():
            handle.seek(info.header_offset + 26)
            name_length, extra_length = (int.from_bytes(handle.read(2), "little") for _ in "ne")
            out[info.filename.split("/", 1)[1]] = (
                info.header_offset + 30 + name_length + extra_length,
                info.file_size,
            )
        return out


def flip(path: Path, member: str, where: float = 0.5) -> None:
    """Flip one bit of ``member``'s bytes, ``where`` of the way into them."""
    offset, size = members(path)[member]
    raw = bytearray(path.read_bytes())
    raw[offset + min(int(size * where), size - 1)] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, optimizer = build("module", seed=0)
    train(model, optimizer, start=0, steps=1)
    path = tmp_path_factory.mktemp("full") / "ckpt.pt"
    checkpoint.save(path, model, optimizer, extra={"step": 1})
    return path


def copy_of(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(saved.read_bytes())
    return path


def test_the_file_as_saved_loads(saved: Path) -> None:
    model, optimizer = build("module", seed=1)
    assert checkpoint.load(saved, model, optimizer) == {"step": 1}
    assert "fsdp_guide.sha256" in members(saved)


def _tensor_members(saved: Path) -> list[str]:
    return sorted((m for m in members(saved) if m.startswith("data/")), key=lambda m: int(m[5:]))


def test_every_member_is_covered(saved: Path) -> None:
    # What the parametrization below flips: every member but the digest, and the digest.
    names = set(members(saved))
    assert names == {*_tensor_members(saved), "data.pkl", "byteorder", "version",
                     ".format_version", ".storage_alignment", ".data/serialization_id",
                     "fsdp_guide.sha256"}  # fmt: skip
    assert len(_tensor_members(saved)) > 20  # weights and both Adam moments


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("which", ["first tensor", "last tensor", "every tensor"])
def test_a_flipped_tensor_byte_is_refused(
    saved: Path, tmp_path: Path, which: str, where: float
) -> None:
    path = copy_of(saved, tmp_path)
    tensors = _tensor_members(saved)
    chosen = {"first tensor": tensors[:1], "last tensor": tensors[-1:], "every tensor": tensors}
    for member in chosen[which]:
        path.write_bytes(saved.read_bytes())
        flip(path, member, where)
        model, optimizer = build("module", seed=1)
        with pytest.raises(CheckpointError, match=rf"{path} does not match the SHA-256 stored"):
            checkpoint.load(path, model, optimizer)


@pytest.mark.parametrize(
    "member",
    ["data.pkl", "byteorder", "version", ".format_version", ".data/serialization_id",
     "fsdp_guide.sha256"],
)  # fmt: skip
def test_a_flipped_byte_elsewhere_is_refused(saved: Path, tmp_path: Path, member: str) -> None:
    path = copy_of(saved, tmp_path)
    flip(path, member)
    with pytest.raises(CheckpointError, match=str(path)):
        checkpoint.load(path, build("module", seed=1)[0])


def load_on_every_rank(rank: int, world_size: int, path: str) -> str:
    model, optimizer = build("ddp", seed=1)
    try:
        checkpoint.load(path, model, optimizer)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_refuses_a_changed_file(saved: Path, tmp_path: Path) -> None:
    path = copy_of(saved, tmp_path)
    flip(path, _tensor_members(saved)[3])
    results = launch(load_on_every_rank, 2, args=(str(path),), start_method="fork")
    assert all(r.startswith(f"{path} does not match the SHA-256 stored in it") for r in results)


def consolidate_and_flip(rank: int, world_size: int, root: str) -> None:
    model, optimizer = build("fsdp2", seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(f"{root}/sharded", model, optimizer, kind="sharded", extra={"step": 1})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_consolidated_file_carries_the_digest(tmp_path: Path) -> None:
    launch(consolidate_and_flip, 2, args=(str(tmp_path),), start_method="fork")
    full = tmp_path / "full.pt"
    checkpoint.consolidate(tmp_path / "sharded", full)
    assert checkpoint.load(full, build("module", seed=1)[0]) == {"step": 1}
    flip(full, _tensor_members(full)[0])
    with pytest.raises(CheckpointError, match="does not match the SHA-256 stored"):
        checkpoint.load(full, build("module", seed=1)[0])


def _written_without_digest(path: Path) -> None:
    model, _ = build("module", seed=0)
    payload: dict[str, Any] = {
        "format": FULL_FORMAT, "version": 2, "strategy": "module", "world_size": 1,
        "optimizer_keys": "name", "optimizer_class": None,
        "model": dict(model.state_dict()), "optimizer": None, "extra": {"step": 0},
    }  # fmt: skip
    torch.save(payload, path)


def test_a_file_without_digest_loads_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    _written_without_digest(path)
    with pytest.warns(UserWarning, match="carries no SHA-256 .* Save it again"):
        assert checkpoint.load(path, build("module", seed=1)[0]) == {"step": 0}


def test_a_file_without_digest_is_checked_against_its_crc32s(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    _written_without_digest(path)
    flip(path, _tensor_members(path)[0])
    with pytest.raises(CheckpointError, match=r"old.pt does not match the CRC-32 of .*data/0"):
        checkpoint.load(path, build("module", seed=1)[0])
