"""The sharded checkpoint directory: written by every rank, checked before loading.

Layout of a directory written by :func:`write_sharded`::

    ckpt/
      index.json              written last: format, strategy, world_size, layout, files
      data-3f2a9c1b7e40/
        __0_0.distcp  __1_0.distcp  .metadata
                              layout "dcp" (PyTorch FSDP1, FSDP2): a torch.distributed.checkpoint
        rank0.pt  rank1.pt    layout "rank_files" (FairScale FSDP): one shard per rank
        *_model_states.pt     layout "deepspeed": DeepSpeed's own files (engine.save_checkpoint)
        extra.pt              the caller's small metadata, written by rank 0

Each save goes to a new ``data-<id>`` directory and ends by replacing ``index.json``
atomically; only then are older ``data-*`` directories removed. Until that rename the index
still names the previous checkpoint's files, so an interrupted save loses nothing. The index
records each file's size and SHA-256; a load compares them before anything is parsed, each
rank hashing its share of the data files.

A failure on one rank must not leave the others waiting in a collective: all ranks raise
the same :class:`~fsdp_guide.errors.CheckpointError` (``fsdp_guide/checkpoint/_agree.py``),
and only once every rank has removed the failed attempt's ``data-<id>`` directory, since a
launcher stops the other ranks as soon as one raises. A rank killed outright leaves its
attempt behind; the next save removes every ``data-*`` directory the index does not name
(:func:`remove_stale_attempts`). A load never removes anything.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from fsdp_guide.checkpoint._agree import Failure, agree, attempt, rank_and_world
from fsdp_guide.checkpoint._dcp import METADATA_NAME, read_metadata
from fsdp_guide.checkpoint._deepspeed import check_fits as deepspeed_fits
from fsdp_guide.checkpoint._index import read_index, verify_sha256
from fsdp_guide.checkpoint._io import (
    DATA_DIR,
    FORMAT_VERSION,
    INDEX_NAME,
    SHARDED_FORMAT,
    atomic_write_bytes,
    atomic_write_torch,
    fsync_directory,
    read_torch,
    sha256_of,
)
from fsdp_guide.engines import Engine, engine_class
from fsdp_guide.errors import CheckpointError

EXTRA_NAME = "extra.pt"


@dataclass(frozen=True)
class Opened:
    """A sharded checkpoint whose index, hashes and metadata were checked."""

    index: dict[str, Any]
    extra: dict[str, Any] | None
    metadata: Metadata | None  # DCP's, for layout "dcp"


def check_sharded_target(path: Path) -> None:
    """Raise unless ``path`` is new, empty, or holds only what :func:`write_sharded` writes.

    A save replaces the older ``data-*`` directories it finds, so a directory holding
    anything else (a dataset, other runs) is refused rather than mixed with checkpoints.

    Raises:
        ValueError: Naming the foreign entries; choose a new or empty directory.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> check_sharded_target(root / "new")
        >>> (root / "data-raw").mkdir()
        >>> check_sharded_target(root)
        Traceback (most recent call last):
        ...
        ValueError: ... holds data-raw, which a sharded checkpoint does not write: ...
    """
    if not path.is_dir():
        return
    foreign = sorted(
        entry.name
        for entry in path.iterdir()
        if not (
            (entry.is_dir() and DATA_DIR.fullmatch(entry.name))
            or entry.name == INDEX_NAME
            or entry.name.startswith(f".{INDEX_NAME}.tmp-")
        )
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (
            f", ... ({len(foreign)} in all)" if len(foreign) > 5 else ""
        )
        raise ValueError(
            f"{path} holds {shown}, which a sharded checkpoint does not write: choose a new or "
            "empty directory (a save removes older checkpoint data in it)"
        )


def shard_name(rank: int) -> str:
    """File name of one rank's shard in the ``"rank_files"`` layout.

    Examples:
        >>> shard_name(3)
        'rank3.pt'
    """
    return f"rank{rank}.pt"


def write_sharded(
    path: Path,
    header: dict[str, Any],
    write: Callable[[Path], list[str]],
    extra: dict[str, Any] | None,
) -> None:
    """Write a sharded checkpoint into the directory ``path`` (collective: every rank calls it).

    Args:
        path: The checkpoint directory.
        header: What the index records besides its files: ``strategy``, ``layout``
            (``"dcp"`` or ``"rank_files"``) and ``optimizer`` (class and state keys, or None).
        write: Writes this rank's part into the new data directory it is given and returns
            the names of the files there that this rank hashes (together, every file once).
        extra: Written by rank 0.

    Raises:
        CheckpointError: On every rank, when writing failed on any rank; the previous
            checkpoint in ``path`` is left as it was.

    Examples:
        A "rank_files" checkpoint, without a process group (as one rank):

        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "ckpt"
        >>> def write(data):
        ...     atomic_write_torch(data / shard_name(0), {"w": torch.ones(2)})
        ...     return [shard_name(0)]
        >>> header = {"strategy": "fairscale_fsdp", "layout": "rank_files", "optimizer": None}
        >>> write_sharded(path, header, write, {"step": 3})
        >>> sorted(p.name for p in path.iterdir())[-1]
        'index.json'
        >>> opened = open_sharded(path, "fairscale_fsdp")
        >>> opened.extra, read_torch(path / opened.index["shards"][0])
        ({'step': 3}, {'w': tensor([1., 1.])})
    """
    finish_sharded(path, begin_sharded(path), header, write, extra)


def begin_sharded(path: Path) -> Path:
    """The new data directory of a save into ``path``, the same on every rank (collective);
    rank 0 first removes what interrupted saves left."""
    rank, world = rank_and_world()
    names = [f"data-{uuid.uuid4().hex[:12]}"]  # matches DATA_DIR
    if rank == 0:
        remove_stale_attempts(path)
    if world > 1:  # every rank must write into the same new sub-directory
        dist.broadcast_object_list(names, src=0)
    return path / names[0]


def finish_sharded(
    path: Path,
    data: Path,
    header: dict[str, Any],
    write: Callable[[Path], list[str]],
    extra: dict[str, Any] | None,
) -> None:
    """Write (or wait for) the data of :func:`begin_sharded`'s directory, hash it, and only
    then replace the index (collective): the arguments of :func:`write_sharded`."""
    rank, world = rank_and_world()
    names = [data.name]

    def write_and_hash() -> dict[str, dict[str, Any]]:
        mine = write(data)
        if rank == 0:
            atomic_write_torch(data / EXTRA_NAME, {"extra": extra})
            mine = [*mine, EXTRA_NAME]
        return {
            f"{names[0]}/{name}": {
                "size": (data / name).stat().st_size,
                "sha256": sha256_of(data / name),
            }
            for name in mine
        }

    def settle(failure: Failure | None, value: Any = None) -> list[Any]:
        # On a failure every rank removes the attempt, and none raises before all are done:
        # a launcher stops the other ranks as soon as one raises, and a cleanup left to one
        # rank (in a finally) was cut short by that in 3 of 9 failed saves.
        try:
            return agree(failure, value)
        except CheckpointError:
            shutil.rmtree(data, ignore_errors=True)
            if world > 1:
                dist.barrier()
            raise

    info, failure = attempt(write_and_hash)
    succeeded = False
    try:
        infos = settle(failure, info)
        if rank == 0:
            index = {
                "format": SHARDED_FORMAT,
                "version": FORMAT_VERSION,
                **header,
                "world_size": world,
                "extra": f"{names[0]}/{EXTRA_NAME}",
                "files": {name: entry for rank_info in infos for name, entry in rank_info.items()},
            }
            if header["layout"] == "dcp":
                index["metadata"] = f"{names[0]}/{METADATA_NAME}"
            elif header["layout"] == "rank_files":
                index["shards"] = [f"{names[0]}/{shard_name(r)}" for r in range(world)]

            def publish() -> None:
                fsync_directory(data)  # the data's directory entries before the index
                atomic_write_bytes(path / INDEX_NAME, json.dumps(index, indent=1).encode())

            _, failure = attempt(publish)
        settle(failure)
        succeeded = True
    finally:
        if rank == 0 and succeeded:  # the older data directories go
            _remove_data_dirs(path, keep=names[0])
        elif rank == 0:  # this attempt's, in case it ended in something other than an error
            shutil.rmtree(data, ignore_errors=True)


def _remove_data_dirs(path: Path, keep: str | None) -> None:
    for data_dir in path.iterdir() if path.is_dir() else []:
        # Never anything this module did not name.
        if DATA_DIR.fullmatch(data_dir.name) and data_dir.is_dir() and data_dir.name != keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def remove_stale_attempts(path: Path) -> None:
    """Remove ``data-*`` directories of ``path`` that its index does not name.

    They are what saves that did not finish left: a rank killed (out of memory, SIGKILL)
    before it could remove its attempt. Without an index every ``data-*`` directory is one;
    with an index that cannot be read, nothing is removed.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "data-0123456789ab").mkdir()
        >>> remove_stale_attempts(root)
        >>> list(root.iterdir())
        []
    """
    if not path.is_dir():
        return
    index_path = path / INDEX_NAME
    keep = None
    if index_path.exists():
        try:
            keep = str(json.loads(index_path.read_text())["extra"]).split("/")[0]
        except (OSError, ValueError, KeyError, TypeError):
            return  # a damaged index: a load reports it, and nothing is guessed here
    _remove_data_dirs(path, keep)


def _saved_engine(path: Path, name: object) -> type[Engine]:
    """The adapter of the engine an index names, refusing a name no engine has."""
    try:
        return engine_class(str(name))
    except ValueError:
        raise CheckpointError(
            f"{path}/{INDEX_NAME} names an unknown engine {name!r}: the index is corrupt or was "
            "not written by fsdp_guide"
        ) from None


def _check_fits(path: Path, index: dict[str, Any], strategy: str, world: int) -> None:
    saved, layout = index["strategy"], index.get("layout", "rank_files")  # 1 had rank files
    consolidate = (
        f"consolidate it (python -m fsdp_guide consolidate {path} FILE) and load the full file"
    )
    if layout == "dcp":
        if not engine_class(strategy).loads_dcp:
            raise CheckpointError(
                f"{path} holds {saved!r} shards, which load at any world size into PyTorch "
                f"FSDP1 or FSDP2, a plain module or DDP; this model is {strategy!r}: {consolidate}"
            )
        return
    if layout == "deepspeed":
        deepspeed_fits(path, index, strategy, world)
        return
    if layout != "rank_files":
        raise CheckpointError(f"{path}/{INDEX_NAME} names an unknown layout {layout!r}")
    if _saved_engine(path, saved).sharded_layout == "dcp":  # rank files of format 1
        raise CheckpointError(
            f"{path} holds {saved!r} shards in fsdp_guide's first sharded format (rank<N>.pt "
            "files), which this version no longer reads: load it with the fsdp_guide version "
            "that saved it and save it again (kind='full', or 'sharded' to get a DCP checkpoint)"
        )
    if saved != strategy:
        raise CheckpointError(
            f"{path} was saved by {saved!r} shards and this model is {strategy!r}; "
            f"{consolidate} to change strategy"
        )
    if index["world_size"] != world:
        raise CheckpointError(
            f"{path} holds {saved!r} shards saved on {index['world_size']} ranks, and this run "
            f"has {world}: FairScale FSDP shards load only at the world size that saved them. "
            f"To change it, {consolidate}"
        )


def _read_checked(path: Path, index: dict[str, Any], to_hash: list[str]) -> Opened:
    verify_sha256(path, index, to_hash)
    extra: dict[str, Any] | None = read_torch(path / index["extra"])["extra"]
    if index.get("layout", "rank_files") != "dcp":
        return Opened(index, extra, None)
    data = index["metadata"].split("/")[0]
    readable = {
        name.split("/", 1)[1]
        for name in index["files"]
        if name.startswith(f"{data}/") and name not in (index["metadata"], index["extra"])
    }
    return Opened(index, extra, read_metadata(path / index["metadata"], readable))


def _share_to_hash(index: dict[str, Any], rank: int, world: int) -> list[str]:
    own = [index["extra"]]
    layout = index.get("layout", "rank_files")
    if layout in ("dcp", "deepspeed"):  # any rank may hash any data file
        own += [index["metadata"]] if layout == "dcp" else []
        data = sorted(set(index["files"]) - set(own))
        return [*data[rank::world], *own]
    return [index["shards"][rank], *own]


def open_sharded(path: Path, strategy: str) -> Opened:
    """Check a sharded checkpoint before loading it (collective: every rank calls it).

    Every file's size is compared on every rank and each data file's SHA-256 on one rank;
    the metadata and ``extra`` (which every rank parses) on each.

    Raises:
        CheckpointError: On every rank, when any rank finds a missing, truncated or changed
            file, unsafe metadata, or a model it does not load into.

    Examples:
        See :func:`write_sharded`.
    """
    rank, world = rank_and_world()

    def read() -> Opened:
        index = read_index(path, verify=False)
        _check_fits(path, index, strategy, world)
        return _read_checked(path, index, _share_to_hash(index, rank, world))

    opened, failure = attempt(read)
    agree(failure)
    assert opened is not None
    return opened


def open_offline(path: Path) -> Opened:
    """Check a sharded checkpoint in one process, every file's hash included.

    Raises:
        CheckpointError: Not a complete, intact sharded checkpoint.

    Examples:
        >>> import tempfile
        >>> open_offline(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: no index.json in ...
    """
    index = read_index(path, verify=True)
    saved = _saved_engine(path, index["strategy"])
    if index.get("layout", "rank_files") == "rank_files" and saved.sharded_layout != "rank_files":
        _check_fits(path, index, index["strategy"], index["world_size"])  # refuses format 1
    return _read_checked(path, index, [])
