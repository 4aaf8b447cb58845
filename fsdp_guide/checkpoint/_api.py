"""save and load: the collective entry points of checkpointing (private)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fsdp_guide.checkpoint._agree import agree, attempt, rank_and_world
from fsdp_guide.checkpoint._async import AsyncSave, save_async
from fsdp_guide.checkpoint._detect import engine_of
from fsdp_guide.checkpoint._dir import check_sharded_target, open_sharded, write_sharded
from fsdp_guide.checkpoint._full import full_payload, read_full, write_full
from fsdp_guide.checkpoint._io import check_weights_only_value
from fsdp_guide.checkpoint._names import check_optimizer_fits, inner_optimizer, state_keys
from fsdp_guide.checkpoint._shards import load_sharded_state, sharded_writer
from fsdp_guide.checkpoint._state import (
    get_full_state,
    set_full_state,
)
from fsdp_guide.engines import Engine, engine_class
from fsdp_guide.errors import CheckpointError
from fsdp_guide.launcher import every_rank_enters

CheckpointKind = Literal["full", "sharded"]


def _check_save_arguments(path: Path, kind: str, engine: Engine | str, extra: Any) -> None:
    adapter = engine_class(engine) if isinstance(engine, str) else type(engine)
    if kind not in ("full", "sharded"):
        raise ValueError(f"kind must be 'full' or 'sharded', got {kind!r}")
    if kind == "sharded" and adapter.sharded_layout is None:
        raise ValueError(
            f"kind='sharded' is for strategies that shard parameters (FSDP1, FSDP2, FairScale "
            f"FSDP, DeepSpeed), not {adapter.name!r}; use kind='full' (sharded optimizer states "
            "such as OSS and ZeRO are consolidated into it)"
        )
    if kind == "full" and not adapter.saves_full:
        raise ValueError(
            f"a {adapter.title} engine saves kind='sharded' ({adapter.title}'s own files); "
            "consolidate that directory (python -m fsdp_guide consolidate DIR FILE) for one "
            "full file"
        )
    if kind == "full" and path.is_dir():
        raise ValueError(f"{path} is a directory; a full checkpoint is a file: choose a file path")
    if kind == "sharded" and path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; a sharded checkpoint is a directory: choose another")
    if kind == "sharded":
        check_sharded_target(path)
    if extra is not None:
        check_weights_only_value(extra)


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    kind: CheckpointKind = "full",
    extra: dict[str, Any] | None = None,
    blocking: bool = True,
) -> Path | AsyncSave:
    """Save model and optimizer state (collective: call on every rank).

    Args:
        path: A file for ``kind="full"``, a directory for ``kind="sharded"``.
        model: The model as trained: plain, DDP, ShardedDDP, FSDP1, FSDP2, FairScale FSDP,
            or a DeepSpeed engine.
        optimizer: Its optimizer (plain, ``ZeroRedundancyOptimizer``, OSS, the engine's), or
            ``None``.
        kind: ``"full"`` (one file, loads anywhere) or ``"sharded"`` (a directory of
            per-rank files; PyTorch FSDP's loads at any world size; a DeepSpeed engine's
            holds DeepSpeed's own files and loads into the same ZeRO stage at the same world
            size, or is consolidated).
        extra: Small metadata to restore with it (step, epoch, RNG state): tensors, numbers,
            strings and containers of them. Rank 0's is saved.
        blocking: ``False`` saves without stopping (``kind="sharded"``, FSDP1 and FSDP2):
            the call returns once each rank's shards are copied into host memory, a thread
            writes them (``torch.distributed.checkpoint.async_save``) while training goes
            on, and the handle's ``wait()``, called by every rank before the next save,
            hashes every file and only then names the new checkpoint in the index. What
            loads is the state at the call; until ``wait()`` ends, the previous checkpoint.

    Returns:
        The path written, or with ``blocking=False`` the handle of the save, whose
        ``wait()`` finishes it and returns the path (``staged_bytes`` gives this rank's
        copy in host memory).

    Raises:
        ValueError: Unknown ``kind``, ``"sharded"`` for a strategy that does not shard
            parameters, a path of the wrong type, a sharded target directory holding
            other files, or ``blocking=False`` without ``kind="sharded"`` or with another
            engine than FSDP1 and FSDP2. Raised before anything is written.
        TypeError: ``extra`` holds something a ``weights_only`` load would refuse.
        CheckpointError: Writing failed on some rank; the previous checkpoint is intact.
        RuntimeError: ``CollectiveCallError``: Some rank did not call it within a few seconds of
            the others (``if rank == 0:`` around the call).

    Examples:
        >>> import tempfile
        >>> model = nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = save(Path(tempfile.mkdtemp()) / "ckpt.pt", model, optimizer, extra={"step": 7})
        >>> load(path, nn.Linear(2, 1), None)
        {'step': 7}
    """
    if blocking is not True:
        if blocking is not False:
            raise ValueError(f"blocking must be True or False, got {blocking!r}")
        if kind != "sharded":
            raise ValueError(
                "blocking=False writes each rank's shards in the background: pass "
                "kind='sharded' (FSDP1, FSDP2)"
            )
        return save_async(path, model, optimizer, extra=extra)
    every_rank_enters("fsdp_guide.checkpoint.save")
    path = Path(path)
    engine = engine_of(model, optimizer)
    strategy = engine.name
    _check_save_arguments(path, kind, engine, extra)
    rank, world = rank_and_world()
    if kind == "full":
        model_state, optim_state = get_full_state(model, optimizer, engine)
        failure = None
        if rank == 0:
            name = type(inner_optimizer(optimizer)).__name__ if optimizer is not None else None
            payload = full_payload(strategy, world, model_state, optim_state, name, extra)
            _, failure = attempt(lambda: write_full(path, payload))
        agree(failure)
        return path
    header, write = sharded_writer(model, optimizer, engine)
    write_sharded(path, header, write, extra)
    return path


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` (collective: call on every rank).

    Build the model and optimizer exactly as for training (same wrapping), then load.
    A full checkpoint loads at any world size and into any strategy. A sharded one of PyTorch
    FSDP1 or FSDP2 loads at any world size into FSDP1, FSDP2, a plain module or DDP; one of
    FairScale FSDP only into FairScale FSDP at the world size that saved it.

    Args:
        path: The file or directory that :func:`save` wrote.
        model: A freshly built model, wrapped like the one to continue training.
        optimizer: Its optimizer, or ``None`` to load the model only.

    Returns:
        The ``extra`` given to :func:`save` (restore RNG states from it yourself).

    Raises:
        CheckpointError: Missing, truncated or changed file, a file that could run code
            (refused before anything in it is built), a sharded checkpoint this model cannot
            take (FairScale FSDP at another world size, ZeRO or OSS), parameter names or shapes
            that differ (listed), an optimizer state the checkpoint lacks, or one of another
            optimizer type (both named).
        RuntimeError: ``CollectiveCallError``: Some rank did not call it within a few seconds of
            the others.

    Examples:
        >>> import tempfile
        >>> load(Path(tempfile.mkdtemp()) / "none.pt", nn.Linear(2, 1))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: checkpoint file .../none.pt does not exist...
    """
    every_rank_enters("fsdp_guide.checkpoint.load")
    path = Path(path)
    engine = engine_of(model, optimizer)
    strategy = engine.name
    if path.is_dir():
        opened = open_sharded(path, strategy)
        if optimizer is not None:
            if opened.index["optimizer"] is None:
                raise CheckpointError(
                    f"{path} holds no optimizer state (saved without an optimizer); pass "
                    "optimizer=None to load the model only"
                )
            if opened.index.get("layout") != "deepspeed":  # DeepSpeed checks its own
                check_optimizer_fits(opened.index["optimizer"], optimizer)
        load_sharded_state(path, opened, model, optimizer, engine)
        return opened.extra
    if not engine.saves_full:
        raise CheckpointError(
            f"{path} is a full checkpoint; a {engine.title} engine loads the sharded directory "
            "its save wrote. Load the full file into the plain model before building the engine"
        )
    payload, failure = attempt(lambda: read_full(path))
    agree(failure)
    assert payload is not None
    if optimizer is not None and payload["optimizer"] is None:
        raise CheckpointError(
            f"{path} holds no optimizer state (saved without an optimizer, or consolidated "
            "from FairScale FSDP shards); pass optimizer=None to load the model only"
        )
    own = engine.full_optimizer_keys == "own"  # FairScale FSDP's gathered form
    if payload["optimizer_keys"] == "position" and not own and optimizer:
        saver = engine_class(payload["strategy"]).title
        raise CheckpointError(
            f"{path} holds a {saver} optimizer state, which loads only into {saver}; pass "
            "optimizer=None to load the model only"
        )
    if payload["optimizer_keys"] != "position" and own and optimizer:
        raise CheckpointError(
            f"{path} holds a {payload['strategy']!r} optimizer state, keyed by parameter name; "
            f"{engine.title} loads only its own optimizer state: pass optimizer=None to load "
            "the model only"
        )
    if optimizer is not None:
        saved = {
            "class": payload.get("optimizer_class"),  # not recorded by format 1
            "state_keys": state_keys(payload["optimizer"]["state"]),
        }
        check_optimizer_fits(saved, optimizer)
    set_full_state(model, optimizer, engine, payload["model"], payload["optimizer"])
    saved_extra: dict[str, Any] | None = payload["extra"]
    return saved_extra
