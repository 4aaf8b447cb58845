"""Saving without stopping: ``save(..., blocking=False)`` and its handle (private).

``torch.distributed.checkpoint.async_save`` copies a rank's state into host memory (staging)
and returns; a background thread writes the copy while training goes on. The copy is what
makes the saved state the state *at the call*, whatever the optimizer does next, and it is
what the call costs: one more copy of the rank's shards in host memory until the write ends.

Here the same write goes into a new ``data-<id>`` directory of a sharded checkpoint
(:mod:`fsdp_guide.checkpoint._dir`), and :meth:`AsyncSave.wait` (collective) finishes it as
:func:`~fsdp_guide.checkpoint.save` does: every rank's files hashed (SHA-256), failures agreed
on, and only then the index replaced atomically. Until then the index names the previous
checkpoint: a rank killed while the thread writes leaves a directory no index names, which
no load reads and the next save removes.

The background thread's collectives run on a gloo group of their own, so they never
interleave with the training step's on the default group.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide.checkpoint import _dcp
from fsdp_guide.checkpoint._agree import rank_and_world
from fsdp_guide.checkpoint._detect import engine_of
from fsdp_guide.checkpoint._dir import begin_sharded, finish_sharded
from fsdp_guide.checkpoint._names import optimizer_record
from fsdp_guide.launcher import every_rank_enters

_GROUPS: dict[int, Any] = {}  # the saving group of each default group


def _saving_group() -> Any:
    """A gloo group over every rank for the background writes (collective the first time)."""
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


class AsyncSave:
    """A save ``save(..., kind="sharded", blocking=False)`` started: its files are being
    written in the background.

    Attributes:
        path: The checkpoint directory.
        returned_after: Seconds the call took to return (the state staged).
        staged_bytes: Bytes of this rank's state copied into host memory for the write.
    """

    def __init__(
        self,
        *,
        path: Path,
        data: Path,
        header: dict[str, Any],
        extra: dict[str, Any] | None,
        upload: Future[Any],
        returned_after: float,
        staged_bytes: int,
    ) -> None:
        self.path = path
        self.returned_after = returned_after
        self.staged_bytes = staged_bytes
        self._data, self._header, self._extra, self._upload = data, header, extra, upload
        self._finished = False

    def done(self) -> bool:
        """Whether this rank's background write has ended (the index is replaced by
        :meth:`wait` only)."""
        return self._upload.done()

    def wait(self) -> Path:
        """Finish the save (collective: every rank calls it): wait for the writes, hash every
        file, then replace the index, as :func:`~fsdp_guide.checkpoint.save` does.

        Returns:
            The checkpoint directory, whose index now names this save.

        Raises:
            CheckpointError: On every rank, when a write failed on any rank; the previous
                checkpoint is still the one the index names.
        """
        if self._finished:
            return self.path
        every_rank_enters("fsdp_guide.checkpoint.AsyncSave.wait")
        rank, world = rank_and_world()

        def written(data: Path) -> list[str]:
            files = _dcp.saved_files(self._upload.result())
            return files[rank::world]  # each file hashed by one rank

        finish_sharded(self.path, self._data, self._header, written, self._extra)
        self._finished = True
        return self.path


def save_async(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start a sharded save of FSDP1 or FSDP2 and return once the state is staged
    (:func:`~fsdp_guide.checkpoint.save` with ``blocking=False``).

    Collective: every rank calls it, then every rank calls :meth:`AsyncSave.wait` before the
    next save (training steps may run in between). The checkpoint is the state at this call,
    in the format of ``save(..., kind="sharded")``, and loads with
    :func:`~fsdp_guide.checkpoint.load`.

    Args:
        path: The checkpoint directory (new, empty, or one this package wrote).
        model: The model as trained: FSDP1 or FSDP2.
        optimizer: Its optimizer, or ``None``.
        extra: Small metadata to restore with it (step, epoch, RNG state); rank 0's.

    Returns:
        The :class:`AsyncSave` handle, whose ``wait()`` finishes the save.

    Raises:
        ValueError: A model whose engine does not write DCP shards (FSDP1 and FSDP2 do), or
            a path :func:`~fsdp_guide.checkpoint.save` would refuse. Raised before anything
            is written.
        TypeError: ``extra`` holds something a ``weights_only`` load would refuse.
    """
    from fsdp_guide.checkpoint._api import _check_save_arguments  # save() imports this module

    every_rank_enters("fsdp_guide.checkpoint.save")
    started = time.perf_counter()
    path = Path(path)
    engine = engine_of(model, optimizer)
    _check_save_arguments(path, "sharded", engine, extra)
    if engine.sharded_layout != "dcp":
        raise ValueError(
            f"blocking=False writes DCP shards (PyTorch FSDP1 and FSDP2), not {engine.title}: "
            "save it with blocking=True"
        )
    group = _saving_group()
    data = begin_sharded(path)
    state = engine.sharded_state(model, optimizer)
    saved = state.get("optimizer")
    record = optimizer_record(optimizer, saved["state"] if saved else None)
    header = {"strategy": engine.name, "layout": "dcp", "optimizer": record}
    upload, staged = _dcp.save_in_background(data, state, group)
    return AsyncSave(
        path=path,
        data=data,
        header=header,
        extra=extra,
        upload=upload,
        returned_after=time.perf_counter() - started,
        staged_bytes=staged,
    )
