"""No code runs from a crafted sharded checkpoint, whichever file carries the payload.

A load reads ``index.json``, DCP's ``.metadata``, the DCP data files and ``extra.pt``. Each
test puts a pickle whose ``__reduce__`` creates a marker file into one of them, rewrites the
index so that sizes and SHA-256 match (an attacker writes the whole directory), first shows
that reading the file the unguarded way runs the payload, then that ``load`` (in one
process and on two ranks) and ``consolidate`` refuse it with a ``CheckpointError`` and the
marker is never created.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import build, train
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from fsdp_guide import checkpoint, launch
from fsdp_guide.checkpoint import CheckpointError
from fsdp_guide.checkpoint._io import sha256_of


class CodePayload:
    """Unpickling this object opens (so creates) ``marker``: code run by the loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def save_sharded_fsdp2(rank: int, world_size: int, path: str) -> None:
    model, optimizer = build("fsdp2", seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 1})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP2 sharded checkpoint, saved once; each test crafts copies of it."""
    path = tmp_path_factory.mktemp("crafted") / "ckpt"
    launch(save_sharded_fsdp2, 2, args=(str(path),), backend="gloo", start_method="fork")
    return path


def index_of(path: Path) -> dict[str, Any]:
    index: dict[str, Any] = json.loads((path / "index.json").read_text())
    return index


def match_index(path: Path, names: list[str]) -> None:
    """Rewrite the index so that the sizes and hashes of ``names`` match their new bytes."""
    index = index_of(path)
    for name in names:
        index["files"][name] = {
            "size": (path / name).stat().st_size,
            "sha256": sha256_of(path / name),
        }
    (path / "index.json").write_text(json.dumps(index))


def torch_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def read_metadata(path: Path) -> Metadata:
    with open(path / index_of(path)["metadata"], "rb") as handle:
        metadata: Metadata = pickle.load(handle)  # our own, freshly saved: the attacker's view
    return metadata


def write_metadata(path: Path, metadata: Metadata) -> None:
    index = index_of(path)
    (path / index["metadata"]).write_bytes(pickle.dumps(metadata))
    match_index(path, [index["metadata"]])


def redirect(path: Path, data_file: str, payload: bytes, only_values: bool = False) -> None:
    """Append ``payload`` to a DCP data file and point its items (or its values) at it."""
    with open(path / data_file, "ab") as handle:
        offset = handle.tell()
        handle.write(payload)
    metadata = read_metadata(path)
    name = data_file.split("/", 1)[1]
    for where, info in list(metadata.storage_data.items()):
        is_value = isinstance(metadata.state_dict_metadata[where.fqn], BytesStorageMetadata)
        if info.relative_path == name and (is_value or not only_values):
            metadata.storage_data[where] = dataclasses.replace(
                info, offset=offset, length=len(payload)
            )
    match_index(path, [data_file])
    write_metadata(path, metadata)


def data_files(path: Path) -> list[str]:
    return sorted(name for name in index_of(path)["files"] if name.endswith(".distcp"))


def craft(path: Path, target: str, marker: Path) -> Callable[[], Any]:
    """Put the payload into ``target``; return how an unguarded reader would read it."""
    index = index_of(path)
    if target == "index":
        crafted = pickle.dumps(CodePayload(marker))
        (path / "index.json").write_bytes(crafted)
        return lambda: pickle.loads(crafted)
    if target == "metadata":
        metadata = read_metadata(path)  # a real metadata object, carrying the payload
        metadata.planner_data["model.head.weight"] = CodePayload(marker)  # type: ignore[index]
        write_metadata(path, metadata)
        # DCP's own FileSystemReader.read_metadata: a plain pickle.load.
        data = path / index["metadata"].split("/")[0]
        return lambda: FileSystemReader(data).read_metadata()
    if target.startswith("data"):
        payload = torch_bytes(CodePayload(marker))
        redirect(path, data_files(path)[int(target[-1])], payload)
        return lambda: torch.load(io.BytesIO(payload), weights_only=False)
    assert target == "extra"
    torch.save({"extra": CodePayload(marker)}, path / index["extra"])
    match_index(path, [index["extra"]])
    return lambda: torch.load(path / index["extra"], weights_only=False)


def load_on_each_rank(rank: int, world_size: int, path: str) -> str:
    model, optimizer = build("fsdp2", seed=1)
    try:
        checkpoint.load(path, model, optimizer)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


TARGETS = {
    "index": r"index\.json is not valid JSON",
    "metadata": r"refused to load .*\.metadata: .*could run code",
    "data0": r"refused to load .*could run code",
    "data1": r"refused to load .*could run code",
    "extra": r"refused to load .*extra\.pt: .*could run code",
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", list(TARGETS))
def test_crafted_file_is_refused_and_its_code_never_runs(
    saved: Path, tmp_path: Path, target: str
) -> None:
    control, crafted = tmp_path / "control", tmp_path / "crafted"
    shutil.copytree(saved, control)
    shutil.copytree(saved, crafted)
    control_marker, marker = tmp_path / "control-ran", tmp_path / "payload-ran"
    read_unguarded = craft(control, target, control_marker)
    craft(crafted, target, marker)
    read_unguarded()  # proves the payload really runs code
    assert control_marker.exists()

    model, optimizer = build("module", seed=1)  # one process, no process group
    with pytest.raises(CheckpointError, match=TARGETS[target]):
        checkpoint.load(crafted, model, optimizer)
    assert not marker.exists()
    messages = launch(
        load_on_each_rank, 2, args=(str(crafted),), backend="gloo", start_method="fork", timeout=90
    )
    assert len(messages) == 2
    for message in messages:  # every rank refused, none hung
        assert message != "loaded"
        assert re.search(TARGETS[target], message), message
    full = tmp_path / "full.pt"
    with pytest.raises(CheckpointError, match=TARGETS[target]):
        checkpoint.consolidate(crafted, full)
    assert not marker.exists()
    assert not full.exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_values_dcp_itself_would_unpickle_unrestricted_are_refused(
    saved: Path, tmp_path: Path
) -> None:
    # DCP stores non-tensor values (an optimizer's lr, betas, parameter names) as torch.save
    # bytes and its DefaultLoadPlanner reads them with weights_only=False.
    control, crafted = tmp_path / "control", tmp_path / "crafted"
    shutil.copytree(saved, control)
    shutil.copytree(saved, crafted)
    control_marker, marker = tmp_path / "control-ran", tmp_path / "payload-ran"
    metadata = read_metadata(saved)
    holder = next(
        info.relative_path
        for where, info in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[where.fqn], BytesStorageMetadata)
    )
    data_file = next(name for name in data_files(saved) if name.endswith(f"/{holder}"))
    redirect(control, data_file, torch_bytes(CodePayload(control_marker)), only_values=True)
    redirect(crafted, data_file, torch_bytes(CodePayload(marker)), only_values=True)

    data = control / data_file.split("/")[0]
    with pytest.raises(TypeError, match="cannot pickle"):  # what open() returned
        dcp_to_torch_save(data, tmp_path / "converted.pt")  # torch's own converter
    assert control_marker.exists()

    with pytest.raises(CheckpointError, match=r"refused to load the DCP value 'optimizer\."):
        checkpoint.consolidate(crafted, tmp_path / "full.pt")
    with pytest.raises(CheckpointError, match=r"refused to load the DCP value 'optimizer\."):
        checkpoint.load(crafted, *build("module", seed=1))
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_metadata_cannot_send_reads_outside_the_checkpoint(saved: Path, tmp_path: Path) -> None:
    crafted = tmp_path / "crafted"
    shutil.copytree(saved, crafted)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(torch_bytes(torch.zeros(4)))
    metadata = read_metadata(crafted)
    where, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[where] = dataclasses.replace(info, relative_path="../../secret.bin")
    write_metadata(crafted, metadata)
    with pytest.raises(CheckpointError, match=r"sends a read of .* to '\.\./\.\./secret\.bin'"):
        checkpoint.load(crafted, *build("module", seed=1))
