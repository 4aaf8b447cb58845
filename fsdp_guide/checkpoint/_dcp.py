"""PyTorch FSDP shards as a ``torch.distributed.checkpoint`` (DCP) directory, read safely.

:func:`torch.distributed.checkpoint.save` writes each rank's pieces into ``__<rank>_0.distcp``
and, from the coordinator, a ``.metadata`` file that records every tensor's whole shape and
where each saved chunk of it lies. :func:`torch.distributed.checkpoint.load` plans its reads
against the sharding of the state dict it is given, so a checkpoint saved on A ranks loads
on B ranks, into FSDP1 (``ShardedTensor``), FSDP2 (``DTensor``) or plain tensors alike.

Read as DCP reads it, a crafted checkpoint would run code in two places, and both are closed
here (the tensors themselves DCP already reads with ``torch.load(weights_only=True)``):

* ``.metadata`` is a plain pickle (``FileSystemReader.read_metadata`` calls
  :func:`pickle.load`). :func:`read_metadata` unpickles it with :class:`_MetadataUnpickler`,
  which builds only DCP's metadata classes, and hands the checked object to DCP
  (:class:`_Reader`), which then never opens the file.
* Values that are not tensors (an optimizer's ``lr``, ``betas``, the parameter names of
  its groups) are stored as ``torch.save`` bytes, which ``DefaultLoadPlanner.load_bytes``
  reads with ``weights_only=False``. :class:`_Planner` reads them with ``weights_only=True``.

Why not rely on the SHA-256 that ``index.json`` records for ``.metadata``: the index lies in
the same directory, and whoever crafted the metadata can write a matching index. The hash
proves the file is the one the index names (nothing truncated or swapped by a bad copy); it
says nothing about who wrote both. What makes reading safe is what the unpickler agrees to
build: pickle runs code only by calling what ``find_class`` returns (and the ``__setstate__``
of what it built), so allowing only side-effect-free constructors and constants means the
worst a crafted file can do is fail to parse, or describe tensors that fail DCP's checks.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_guide.checkpoint._write_errors import RecordingFile, raise_named, tensor_bytes
from fsdp_guide.errors import CheckpointError

METADATA_NAME = ".metadata"  # the name FileSystemWriter gives the metadata file
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Every global a DCP .metadata file of torch 2.13 refers to, found by recording find_class
# while unpickling real checkpoints; each is a dataclass, an enum, torch.Size, a path or a
# lookup of a torch constant by name: building one runs no code of the file's choosing.
_ALLOWED_GLOBALS = frozenset(
    {
        *(
            (_METADATA_MODULE, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # torch.strided and the like, by name
        # StorageMeta.checkpoint_id is the path saved to (pathlib._local from Python 3.13).
        *(
            (module, cls)
            for module in ("pathlib", "pathlib._local")
            for cls in ("PosixPath", "WindowsPath")
        ),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype is pickled as the name of a torch constant
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def _refused(what: object, detail: Any) -> CheckpointError:
    return CheckpointError(
        f"refused to load {what}: it carries pickled objects other than DCP metadata, "
        "tensors and plain values, which could run code. Only load checkpoints written by "
        f"fsdp_guide.checkpoint.save from a source you trust. Detail: {detail}"
    )


def read_metadata(path: Path, data_files: Collection[str]) -> Metadata:
    """Unpickle a DCP ``.metadata`` file safely and check what DCP will do with it.

    Args:
        path: The ``.metadata`` file.
        data_files: Names (relative to its directory) of the data files the index lists:
            the only files the metadata may send DCP's reads to.

    Raises:
        CheckpointError: The file refers to anything but DCP's metadata classes (nothing of
            it is built), is not DCP metadata, or sends reads to other files.

    Examples:
        >>> import tempfile
        >>> from fsdp_guide.errors import CheckpointError
        >>> path = Path(tempfile.mkdtemp()) / ".metadata"
        >>> _ = path.write_bytes(pickle.dumps(print))
        >>> read_metadata(path, [])
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: refused to load .../.metadata: ... builtins.print ...
    """
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise _refused(path, exc) from exc
    except Exception as exc:  # a truncated or garbled pickle fails in many ways
        raise CheckpointError(f"{path} is not readable DCP metadata ({exc!r})") from exc
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(metadata.storage_data, dict)
        and isinstance(metadata.planner_data, dict | None)
    ):
        raise CheckpointError(f"{path} is not DCP metadata")
    for fqn, item in metadata.state_dict_metadata.items():
        tensor_ok = isinstance(item, TensorStorageMetadata) and isinstance(
            item.properties.dtype, torch.dtype
        )
        if not (isinstance(fqn, str) and (tensor_ok or isinstance(item, BytesStorageMetadata))):
            raise CheckpointError(f"{path} describes {fqn!r} in a way DCP does not write")
    for where, info in metadata.storage_data.items():
        if not (
            isinstance(where, MetadataIndex)
            and isinstance(info, _StorageInfo)
            and info.relative_path in data_files
            and not info.transform_descriptors  # fsdp_guide writes no compressed streams
        ):
            raise CheckpointError(
                f"{path} sends a read of {getattr(where, 'fqn', where)!r} to "
                f"{getattr(info, 'relative_path', info)!r}, which is not a data file the index "
                "lists: the checkpoint is corrupt or was not written by fsdp_guide"
            )
    entries = len(metadata.state_dict_metadata)
    for fqn, key_path in (metadata.planner_data or {}).items():
        # List indices are bounded by the number of values, so no index allocates much.
        if not (
            isinstance(key_path, tuple)
            and key_path
            and isinstance(key_path[0], str)
            and all(
                isinstance(k, str) or (isinstance(k, int) and 0 <= k < entries) for k in key_path
            )
        ):
            raise CheckpointError(f"{path} maps {fqn!r} to {key_path!r}, not a key path")
    return metadata


def set_path(root: dict[str, Any], key_path: tuple[str | int, ...], value: Any) -> None:
    """Set ``value`` at ``key_path`` (dict keys and list indices), creating what is missing.

    Examples:
        >>> root = {}
        >>> set_path(root, ("optimizer", "param_groups", 0, "lr"), 0.1)
        >>> root
        {'optimizer': {'param_groups': [{'lr': 0.1}]}}
    """
    node: Any = root
    for key, following in itertools.pairwise(key_path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            assert isinstance(key, int)
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
            node = node[key]
        else:
            node = node.setdefault(key, empty)
    last = key_path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


class _Reader(FileSystemReader):
    """DCP's file reader, given metadata already read by :func:`read_metadata`."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._checked


class _Planner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values with ``weights_only=True``.

    It also plans without DCP's guess at checkpoints of torch 2.3 and older. When a key of
    the checkpoint is absent from this rank's flattened state dict, DCP's planner assumes
    an old checkpoint and flattens again the old way, which turns the optimizer's
    ``param_groups`` into one key the checkpoint lacks ("Missing key in checkpoint
    state_dict: optimizer.param_groups"). A key is absent for a common reason, though: an
    FSDP1 optimizer state gives a rank whose shard of a small parameter is empty a
    ``ShardedTensor`` without local shards, which DCP drops before planning. Such a rank
    has nothing of that tensor to read, so planning the keys it has is right; fsdp_guide
    needs torch 2.6 or newer, so no checkpoint it reads was flattened the old way.
    """

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        return create_default_local_load_plan(
            self.state_dict, self.metadata, not self.allow_partial_load
        )

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _refused(f"the DCP value {fqn!r}", exc) from exc
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class _NamingFileSystem(FileSystem):
    """DCP's file system, whose written files name a failure for lack of space as such."""

    def __init__(self, needed: int) -> None:
        super().__init__()
        self.needed = needed

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        recorder = None
        try:
            with super().create_stream(path, mode) as stream:
                recorder = RecordingFile(stream)
                yield recorder
        except Exception as exc:
            raise_named(exc, recorder, Path(path), self.needed)
            raise


def save(directory: Path, state: dict[str, Any]) -> list[str]:
    """``dcp.save`` of ``state`` into a new ``directory`` (collective: every rank calls it).

    Returns:
        Names (relative to ``directory``) of every file of the checkpoint, metadata last.

    Raises:
        CheckpointException: DCP's own, on every rank, when writing failed on any rank
            (a failure for lack of space carries a ``CheckpointError`` saying so).
    """
    writer = FileSystemWriter(directory, overwrite=False)  # fsyncs each file it writes
    writer.fs = _NamingFileSystem(tensor_bytes(state))
    return saved_files(dcp_save(state, storage_writer=writer))


def saved_files(metadata: Metadata) -> list[str]:
    """Names (relative to the directory) of every file a DCP save wrote, metadata last."""
    files = {info.relative_path for info in metadata.storage_data.values()}
    return [*sorted(files), METADATA_NAME]


def save_in_background(directory: Path, state: dict[str, Any], group: Any) -> tuple[Any, int]:
    """``dcp.async_save`` of ``state`` into a new ``directory`` (collective): the state is
    copied into host memory before this returns, then written by a background thread whose
    collectives run on ``group``.

    Returns:
        The future of the write (its result: DCP's metadata) and the bytes staged.
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save

    writer = FileSystemWriter(directory, overwrite=False)  # fsyncs each file it writes
    needed = tensor_bytes(state)
    writer.fs = _NamingFileSystem(needed)
    future = async_save(state, storage_writer=writer, process_group=group)
    return future, needed


def load(directory: Path, state: dict[str, Any], metadata: Metadata, no_dist: bool = False) -> None:
    """``dcp.load`` into ``state`` in place, safely (collective unless ``no_dist``).

    Raises:
        CheckpointException: DCP's own, on every rank, when reading failed on any rank
            (:func:`describe_failure` turns it into a message).
    """
    reader = _Reader(directory, metadata)
    no_dist = no_dist or not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        # DCP warns that it assumes one process whenever no_dist is set; here that is meant.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_load(state, storage_reader=reader, planner=_Planner(), no_dist=no_dist)


def load_everything(directory: Path, metadata: Metadata) -> dict[str, Any]:
    """Every value of a DCP checkpoint as whole tensors, in this process (no process group).

    The state dict to load into is built from the metadata: an empty tensor of each whole
    shape, placed at the key path DCP flattened it from.

    Raises:
        CheckpointError: A file could not be read or was refused.
    """
    nested: dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    try:
        for fqn, item in metadata.state_dict_metadata.items():
            empty = None
            if isinstance(item, TensorStorageMetadata):
                empty = torch.empty(item.size, dtype=item.properties.dtype)
            set_path(nested, mappings.get(fqn, (fqn,)), empty)
    except (AssertionError, TypeError, RuntimeError, MemoryError) as exc:
        raise CheckpointError(
            f"the DCP metadata in {directory} describes values that do not fit together "
            f"({type(exc).__name__}: {exc}): the checkpoint is corrupt"
        ) from exc
    try:
        load(directory, nested, metadata, no_dist=True)
    except CheckpointException as exc:
        raise CheckpointError(describe_failure(exc)[1]) from None
    return nested


def describe_failure(exc: CheckpointException) -> tuple[int, str]:
    """The first failing rank of a DCP failure and a message for it (no traceback).

    Examples:
        >>> describe_failure(CheckpointException("read", {1: (OSError("disk full"), None)}))
        (1, 'OSError: disk full')
    """
    rank = min(exc.failures)
    cause = exc.failures[rank][0]
    if isinstance(cause, CheckpointError):
        return rank, str(cause)
    if isinstance(cause, pickle.UnpicklingError):  # a tensor refused by weights_only=True
        return rank, str(_refused("a tensor of the DCP checkpoint", cause))
    return rank, f"{type(cause).__name__}: {cause}"
