"""Files of a checkpoint: atomic writes, ``weights_only`` reads, and the index of a directory.

Everything here is single-process and knows nothing about models: it turns a nested
structure of tensors and plain values into bytes on disk and back, safely.

* A write goes to a hidden file beside the target, is flushed and ``fsync``-ed, then
  renamed over the target (:func:`os.replace` is atomic on POSIX). A crash half-way leaves
  the old file untouched and, at worst, a ``.*.tmp-*`` file that nothing reads.
* A read uses ``torch.load(weights_only=True)``: only tensors, numbers, strings and
  containers come back, and a file carrying any other pickled object is refused before that
  object is built, so no code in it runs. A file that is not a zip archive (what
  ``torch.save`` writes) is refused as truncated or corrupt before anything parses it.
* A sharded checkpoint is a directory whose ``index.json`` is written last and names every
  file with its size and SHA-256, so a missing or truncated shard is found before loading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import uuid
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from fsdp_guide.errors import CheckpointError

INDEX_NAME = "index.json"
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def check_weights_only_value(value: Any, where: str = "extra") -> None:
    """Raise if ``value`` holds something ``torch.load(weights_only=True)`` would refuse.

    Checked before a save starts, so a checkpoint that could not be read back is never written.

    Args:
        value: Nested dicts (str or int keys), lists and tuples of tensors, numbers, strings,
            bytes, ``None``, dtypes and devices.
        where: Name of the value, for the message.

    Raises:
        TypeError: Naming the first offending entry and what to convert it to.

    Examples:
        >>> check_weights_only_value({"step": 3, "rng": torch.get_rng_state()})
        >>> check_weights_only_value({"when": object()})
        Traceback (most recent call last):
        ...
        TypeError: extra['when'] is a object; a checkpoint holds only tensors, numbers, ...
    """
    if isinstance(value, (torch.Tensor, torch.Size, *_SCALARS)):
        return
    if isinstance(value, dict | OrderedDict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or int")
            check_weights_only_value(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_weights_only_value(item, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, numbers, "
        "strings, bytes, None and dicts/lists/tuples of them (loading uses weights_only=True): "
        "convert it, e.g. to a dict of plain values or a tensor"
    )


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem allows opening a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(target: Path, write: Any) -> None:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_directory(target.parent)


def atomic_write_torch(target: Path, payload: Any) -> None:
    """``torch.save(payload)`` to ``target`` so that it is either the old file or the whole new one.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> atomic_write_torch(path, {"x": torch.ones(2)})
        >>> read_torch(path)["x"]
        tensor([1., 1.])
    """
    _atomic_write(target, lambda handle: torch.save(payload, handle))


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (beside, flush, fsync, rename).

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.json"
        >>> atomic_write_bytes(path, b"{}")
        >>> path.read_bytes()
        b'{}'
    """
    _atomic_write(target, lambda handle: handle.write(data))


def read_torch(path: Path) -> Any:
    """Load a file written by :func:`atomic_write_torch`, refusing anything but plain data.

    Raises:
        CheckpointError: The file is missing, truncated or not a torch file, or it carries a
            pickled object other than tensors and plain values (that object is not built).

    Examples:
        >>> import tempfile
        >>> read_torch(Path(tempfile.mkdtemp()) / "nothing.pt")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: checkpoint file .../nothing.pt does not exist...
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist; check the path")
    if not zipfile.is_zipfile(path):
        # torch.save writes a zip archive; anything else (a file cut short, bytes of another
        # format) is refused before torch.load would parse it as a legacy pickle.
        raise CheckpointError(
            f"{path} is truncated or corrupt: it is not the zip archive torch.save writes "
            "(nothing in it was unpickled); restore it or use an earlier checkpoint"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refused to load {path}: it carries pickled objects other than tensors and plain "
            "values, which could run code (weights_only=True). Only load checkpoints written "
            f"by fsdp_guide.checkpoint.save from a source you trust. Detail: {exc}"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is truncated or corrupt (torch.load failed: {exc}); restore it or use "
            "an earlier checkpoint"
        ) from exc


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file's bytes.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "x"
        >>> _ = path.write_bytes(b"")
        >>> sha256_of(path)[:12]
        'e3b0c44298fc'
    """
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_index(directory: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``index.json`` of a sharded checkpoint and check every file it names.

    Args:
        directory: The checkpoint directory.
        verify: Also compare each file's SHA-256 (sizes are always compared).

    Returns:
        The index: ``format``, ``version``, ``strategy``, ``world_size``, ``files``
        (relative path to ``{"size", "sha256"}``) and ``shards`` (one relative path per rank).

    Raises:
        CheckpointError: No index (an unfinished or foreign directory), a file missing,
            of the wrong size or with the wrong hash.

    Examples:
        >>> import tempfile
        >>> read_index(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: no index.json in ...: not a finished sharded ...
    """
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise CheckpointError(
            f"no {INDEX_NAME} in {directory}: not a finished sharded checkpoint (a save that "
            "did not complete writes its index last); use an earlier checkpoint"
        )
    try:
        index: dict[str, Any] = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path} is not valid JSON ({exc})") from exc
    if index.get("format") != "fsdp_guide.sharded":
        raise CheckpointError(f"{index_path} is not an fsdp_guide sharded checkpoint index")
    for name, info in index["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(
                f"missing shard {name} in {directory} (the index lists {len(index['files'])} "
                "files); copy the whole directory, or use an earlier checkpoint"
            )
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"shard {name} in {directory} is truncated or changed: {size} bytes, the index "
                f"says {info['size']}; copy it again or use an earlier checkpoint"
            )
        if verify and sha256_of(path) != info["sha256"]:
            raise CheckpointError(
                f"shard {name} in {directory} does not match its SHA-256 in the index: it was "
                "changed after saving; copy it again or use an earlier checkpoint"
            )
    return index
