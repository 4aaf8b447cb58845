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
  file with its size and SHA-256, so a missing, truncated or changed file is found before
  loading. (The hash proves integrity, not origin: whoever writes a file can write a
  matching index. Safety comes from how each file is parsed; see
  ``fsdp_guide/checkpoint/_dcp.py`` for DCP's pickled ``.metadata``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import uuid
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fsdp_guide.errors import CheckpointError

INDEX_NAME = "index.json"
# 2: torch FSDP shards are a torch.distributed.checkpoint (DCP) directory; full files and
# FairScale shards have not changed since 1, and load as before.
FORMAT_VERSION = 2
FULL_FORMAT = "fsdp_guide.full"
SHARDED_FORMAT = "fsdp_guide.sharded"
DATA_DIR = re.compile(r"data-[0-9a-f]{12}")  # the only sub-directories a sharded save names
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


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (new and renamed files) durable, where allowed.

    Examples:
        >>> import tempfile
        >>> fsync_directory(Path(tempfile.mkdtemp()))
    """
    # Not every filesystem allows opening a directory: then this is a no-op.
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
    fsync_directory(target.parent)


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


def verify_sha256(directory: Path, index: dict[str, Any], names: Iterable[str]) -> None:
    """Compare the SHA-256 of each file in ``names`` with the one ``index`` records.

    Raises:
        CheckpointError: Naming the first file whose bytes changed after saving.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "a").write_bytes(b"")
        >>> verify_sha256(root, {"files": {"a": {"sha256": "0" * 64}}}, ["a"])
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: a in ... does not match its SHA-256 in the index: ...
    """
    for name in names:
        if sha256_of(directory / name) != index["files"][name]["sha256"]:
            raise CheckpointError(
                f"{name} in {directory} does not match its SHA-256 in the index: it was "
                "changed after saving; copy it again or use an earlier checkpoint"
            )


def _check_file_name(directory: Path, name: Any) -> None:
    # Only "data-<id>/<file>": an index must not make a load open files elsewhere.
    parts = name.split("/") if isinstance(name, str) else []
    if len(parts) != 2 or not DATA_DIR.fullmatch(parts[0]) or parts[1] in ("", ".", ".."):
        raise CheckpointError(
            f"{directory / INDEX_NAME} names {name!r}, which is not a file of a data-<id> "
            "directory: the index is corrupt or was not written by fsdp_guide"
        )


def read_index(directory: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``index.json`` of a sharded checkpoint and check every file it names.

    Args:
        directory: The checkpoint directory.
        verify: Also compare each file's SHA-256 (sizes are always compared); see
            :func:`verify_sha256` to hash some files only.

    Returns:
        The index: ``format``, ``version``, ``strategy``, ``world_size``, ``layout``,
        ``data`` (the ``data-<id>`` directory), ``optimizer`` (its class and state keys, or
        ``None``) and ``files`` (relative path to ``{"size", "sha256"}``).

    Raises:
        CheckpointError: No index (an unfinished or foreign directory), an index of a newer
            format, a file missing, of the wrong size or with the wrong hash.

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
    if not isinstance(index, dict) or index.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{index_path} is not an fsdp_guide sharded checkpoint index")
    if not isinstance(index.get("version"), int) or index["version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{index_path} has format version {index.get('version')!r}; this fsdp_guide reads "
            f"versions up to {FORMAT_VERSION}: upgrade fsdp_guide"
        )
    files = index.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{index_path} lists no files: the index is corrupt")
    for name, info in files.items():
        _check_file_name(directory, name)
        path = directory / name
        if not path.is_file():
            raise CheckpointError(
                f"missing checkpoint file {name} in {directory} (the index lists {len(files)} "
                "files); copy the whole directory, or use an earlier checkpoint"
            )
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"{name} in {directory} is truncated or changed: {size} bytes, the index "
                f"says {info['size']}; copy it again or use an earlier checkpoint"
            )
    if verify:
        verify_sha256(directory, index, files)
    return index
