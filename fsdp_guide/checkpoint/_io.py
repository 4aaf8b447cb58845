"""Files of a checkpoint: atomic writes and ``weights_only`` reads.

Everything here is single-process and knows nothing about models: it turns a nested
structure of tensors and plain values into bytes on disk and back, safely.

* A write goes to a hidden file beside the target, is flushed and ``fsync``-ed, then
  renamed over the target (:func:`os.replace` is atomic on POSIX). A crash half-way leaves
  the old file untouched and, at worst, a ``.<target>.tmp-<host>-<pid>-*`` file that nothing
  reads and that the next write of the same target removes once its writer is gone
  (``fsdp_guide/checkpoint/_temps.py``). A write that fails for lack of space says so, with
  the free space and the bytes needed (``fsdp_guide/checkpoint/_write_errors.py``).
* A full checkpoint file also stores a SHA-256 of its contents, checked before it is
  unpickled (``fsdp_guide/checkpoint/_digest.py``).
* A read uses ``torch.load(weights_only=True)``: only tensors, numbers, strings and
  containers come back, and a file carrying any other pickled object is refused before that
  object is built, so no code in it runs. A file that is not a zip archive (what
  ``torch.save`` writes) is refused as truncated or corrupt before anything parses it.
* A sharded checkpoint is a directory whose ``index.json`` is written last and names every
  file with its size and SHA-256 (``fsdp_guide/checkpoint/_index.py``), so a missing,
  truncated or changed file is found before loading. (The hash proves integrity, not
  origin: whoever writes a file can write a matching index. Safety comes from how each
  file is parsed; see ``fsdp_guide/checkpoint/_dcp.py`` for DCP's pickled ``.metadata``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_guide.checkpoint import _digest
from fsdp_guide.checkpoint._temps import remove_stale_temps, temp_path
from fsdp_guide.checkpoint._write_errors import RecordingFile, raise_named, tensor_bytes
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


def _make_parent(target: Path) -> None:
    for parent in (target.parent, *target.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(
                    f"cannot write {target}: {parent} is a file, not a directory; choose "
                    "another path"
                )
            break
    target.parent.mkdir(parents=True, exist_ok=True)


def _atomic_write(
    target: Path, write: Callable[[Any], object], needed: int | None, seal: bool = False
) -> None:
    target = Path(target)
    _make_parent(target)
    remove_stale_temps(target)  # left by writers of this target killed half-way
    tmp = temp_path(target)
    try:
        handle = None
        try:
            with open(tmp, "wb") as raw:
                handle = RecordingFile(raw)
                write(handle)
                handle.flush()
                os.fsync(raw.fileno())
            if seal:
                _digest.seal(tmp)  # from the bytes on disk, not from memory
                with open(tmp, "rb+") as raw:
                    os.fsync(raw.fileno())
        except Exception as exc:
            raise_named(exc, handle, target, needed)
            raise
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_directory(target.parent)


def atomic_write_torch(target: Path, payload: Any, seal: bool = False) -> None:
    """``torch.save(payload)`` to ``target`` so that it is either the old file or the whole new one.

    Temporary files of ``target`` left by writers that were killed are removed first. A
    write that fails for lack of space raises a :class:`CheckpointError` naming the cause,
    the free space and the bytes the payload's tensors take.

    Args:
        target: The file to write.
        payload: What to save.
        seal: Store a SHA-256 of the contents in the file (a full checkpoint), which
            :func:`fsdp_guide.checkpoint._digest.verify` checks.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> atomic_write_torch(path, {"x": torch.ones(2)})
        >>> read_torch(path)["x"]
        tensor([1., 1.])
    """
    _atomic_write(target, lambda handle: torch.save(payload, handle), tensor_bytes(payload), seal)


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (beside, flush, fsync, rename).

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.json"
        >>> atomic_write_bytes(path, b"{}")
        >>> path.read_bytes()
        b'{}'
    """
    _atomic_write(target, lambda handle: handle.write(data), len(data))


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
