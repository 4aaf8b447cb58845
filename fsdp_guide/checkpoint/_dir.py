"""The sharded checkpoint directory, and how ranks agree on a failure.

Layout of a directory written by :func:`write_sharded`::

    ckpt/
      index.json              written last: format, strategy, world_size, shards, files
      data-3f2a9c1b7e40/
        rank0.pt  rank1.pt    one shard per rank (plain tensors, weights_only)
        extra.pt              the caller's small metadata, written by rank 0

Each save goes to a new ``data-<id>`` directory and ends by replacing ``index.json``
atomically; only then are older ``data-*`` directories removed. Until that rename the index
still names the previous checkpoint's files, so an interrupted save loses nothing.

A failure on one rank must not leave the others waiting in a collective: every rank catches
its own error (:func:`attempt`), the errors are exchanged (:func:`agree`), and all ranks raise
the same :class:`~fsdp_guide.errors.CheckpointError`.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from fsdp_guide.checkpoint._io import (
    INDEX_NAME,
    atomic_write_bytes,
    atomic_write_torch,
    read_index,
    read_torch,
    sha256_of,
)
from fsdp_guide.errors import CheckpointError

FORMAT_VERSION = 1
DATA_DIR = re.compile(r"data-[0-9a-f]{12}")  # the sub-directories write_sharded names
_T = TypeVar("_T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one.

    Examples:
        >>> rank_and_world()
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def attempt(action: Callable[[], _T]) -> tuple[_T | None, str | None]:
    """Run ``action``; return ``(value, None)``, or ``(None, message)`` if it raised.

    Examples:
        >>> attempt(lambda: 1 / 0)
        (None, 'ZeroDivisionError: division by zero')
    """
    try:
        return action(), None
    except CheckpointError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def agree(error: str | None) -> None:
    """Share each rank's error with all ranks (collective); all raise the first one.

    Raises:
        CheckpointError: Some rank reported an error; prefixed with its rank when several run.

    Examples:
        >>> agree(None)
        >>> agree("disk full")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: disk full
    """
    _, world = rank_and_world()
    errors: list[str | None] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(message if world == 1 else f"rank {rank}: {message}")


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


def write_sharded(
    path: Path, shard: dict[str, Any], strategy: str, extra: dict[str, Any] | None
) -> None:
    """Write this rank's shard into the directory ``path`` (collective: every rank calls it).

    Raises:
        CheckpointError: On every rank, when writing failed on any rank; the previous
            checkpoint in ``path`` is left as it was.

    Examples:
        Without a process group, as one rank:

        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "ckpt"
        >>> shard = {"model": {"w": torch.ones(2)}, "optimizer": None, "layout": {}}
        >>> write_sharded(path, shard, "fsdp2", {"step": 3})
        >>> sorted(p.name for p in path.iterdir())[-1]
        'index.json'
        >>> read_sharded(path, "fsdp2")
        ({'model': {'w': tensor([1., 1.])}, 'optimizer': None, 'layout': {}}, {'step': 3})
    """
    rank, world = rank_and_world()
    names = [f"data-{uuid.uuid4().hex[:12]}"]  # matches DATA_DIR
    if world > 1:  # every rank must write into the same new sub-directory
        dist.broadcast_object_list(names, src=0)
    data = path / names[0]

    def write_own_files() -> dict[str, dict[str, Any]]:
        written = {f"rank{rank}.pt": shard}
        if rank == 0:
            written["extra.pt"] = {"extra": extra}
        info = {}
        for name, payload in written.items():
            atomic_write_torch(data / name, payload)
            info[f"{names[0]}/{name}"] = {
                "size": (data / name).stat().st_size,
                "sha256": sha256_of(data / name),
            }
        return info

    info, error = attempt(write_own_files)
    gathered: list[Any] = [(info, error)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (info, error))
    error = next((f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e), None)
    if error is None and rank == 0:
        files: dict[str, Any] = {}
        for rank_info, _ in gathered:
            files.update(rank_info)
        index = {
            "format": "fsdp_guide.sharded",
            "version": FORMAT_VERSION,
            "strategy": strategy,
            "world_size": world,
            "shards": [f"{names[0]}/rank{r}.pt" for r in range(world)],
            "extra": f"{names[0]}/extra.pt",
            "files": files,
        }
        _, error = attempt(
            lambda: atomic_write_bytes(path / INDEX_NAME, json.dumps(index, indent=1).encode())
        )
    if rank == 0:
        # After a success the older data directories go; after a failure, this attempt's.
        for data_dir in path.iterdir():
            if not DATA_DIR.fullmatch(data_dir.name) or not data_dir.is_dir():
                continue  # never anything this module did not name
            if (data_dir.name == names[0]) == (error is not None):
                shutil.rmtree(data_dir, ignore_errors=True)
    outcome = [error]  # rank 0 knows every rank's write error and its own index error
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])


def read_sharded(path: Path, strategy: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Read this rank's shard and the saved ``extra`` (collective: every rank calls it).

    Returns:
        ``(shard, extra)``.

    Raises:
        CheckpointError: On every rank, when any rank finds a missing, truncated or changed
            file, another world size, or a strategy whose shards do not fit.

    Examples:
        See :func:`write_sharded`.
    """
    rank, world = rank_and_world()

    def read() -> tuple[dict[str, Any], dict[str, Any] | None]:
        index = read_index(path, verify=False)
        if index["world_size"] != world:
            raise CheckpointError(
                f"{path} is a sharded checkpoint saved on {index['world_size']} ranks, and "
                f"this run has {world}: a sharded checkpoint loads only at the world size that "
                f"saved it. Consolidate it (python -m fsdp_guide consolidate {path} FILE) and "
                "load the full file"
            )
        saved = index["strategy"]
        torch_fsdp = ("fsdp1", "fsdp2")
        if saved != strategy and not (saved in torch_fsdp and strategy in torch_fsdp):
            raise CheckpointError(
                f"{path} was saved by {saved!r} shards and this model is {strategy!r}; "
                "consolidate it into a full checkpoint to change strategy"
            )
        for name in (index["shards"][rank], index["extra"]):  # what this rank reads
            if sha256_of(path / name) != index["files"][name]["sha256"]:
                raise CheckpointError(f"{path / name} does not match its SHA-256 in the index")
        shard = read_torch(path / index["shards"][rank])
        extra: dict[str, Any] | None = read_torch(path / index["extra"])["extra"]
        return shard, extra

    result, error = attempt(read)
    agree(error)
    assert result is not None
    return result


def read_all_shards(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """Read the index, every shard and ``extra`` in one process, all hashes checked.

    Returns:
        ``(index, shards ordered by rank, extra)``.

    Raises:
        CheckpointError: Not a complete, intact sharded checkpoint.

    Examples:
        >>> import tempfile
        >>> read_all_shards(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: no index.json in ...
    """
    index = read_index(path, verify=True)
    shards = [read_torch(path / name) for name in index["shards"]]
    return index, shards, read_torch(path / index["extra"])["extra"]
