"""The full checkpoint file: what it holds, written with its digest, read only once verified.

Written by :func:`~fsdp_guide.checkpoint.save` (``kind="full"``) and by
:func:`~fsdp_guide.checkpoint.consolidate`; both go through :func:`write_full`, so every
full file carries the SHA-256 of its contents (``fsdp_guide/checkpoint/_digest.py``), and
:func:`read_full` checks it before anything in the file is unpickled.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from fsdp_guide.checkpoint import _digest
from fsdp_guide.checkpoint._io import FORMAT_VERSION, FULL_FORMAT, atomic_write_torch, read_torch
from fsdp_guide.engines import engine_class
from fsdp_guide.errors import CheckpointError


def full_payload(
    strategy: str,
    world_size: int,
    model_state: dict[str, Any] | None,
    optim_state: dict[str, Any] | None,
    optimizer_class: str | None,
    extra: Any,
) -> dict[str, Any]:
    """What a full checkpoint file holds.

    Examples:
        >>> sorted(full_payload("ddp", 2, {}, None, None, {"step": 1}))
        ['extra', 'format', 'model', 'optimizer', 'optimizer_class', 'optimizer_keys', ...]
    """
    return {
        "format": FULL_FORMAT,
        "version": FORMAT_VERSION,
        "strategy": strategy,
        "world_size": world_size,
        # An engine's own gathered optimizer state (FairScale FSDP's) is keyed by position.
        "optimizer_keys": "position"
        if engine_class(strategy).full_optimizer_keys == "own" and optim_state is not None
        else "name",
        "optimizer_class": optimizer_class,
        "model": model_state,
        "optimizer": optim_state,
        "extra": extra,
    }


def write_full(path: Path, payload: dict[str, Any]) -> None:
    """Write a full checkpoint atomically, with the SHA-256 of its contents stored in it.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "full.pt"
        >>> write_full(path, full_payload("module", 1, {}, None, None, {"step": 2}))
        >>> read_full(path)["extra"]
        {'step': 2}
    """
    atomic_write_torch(path, payload, seal=True)


def read_full(path: Path) -> dict[str, Any]:
    """Read a full checkpoint once its bytes are verified against the digest it carries.

    A file without a digest (saved by an earlier fsdp_guide) is checked against its zip
    CRC-32s instead, and loads with a warning.

    Raises:
        CheckpointError: Missing, truncated, changed (bytes that do not match the stored
            digest), not a full checkpoint, or carrying objects that could run code.

    Examples:
        >>> import tempfile
        >>> read_full(Path(tempfile.mkdtemp()) / "none.pt")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: checkpoint file .../none.pt does not exist...
    """
    path = Path(path)
    if path.is_file() and zipfile.is_zipfile(path):  # else read_torch says what it is
        _digest.verify(path)
    payload = read_torch(path)
    if (
        not isinstance(payload, dict)
        or payload.get("format") != FULL_FORMAT
        or not isinstance(payload.get("model"), dict)
        or not isinstance(payload.get("optimizer"), dict | None)
        or payload.get("optimizer_keys") not in ("name", "position")
    ):
        raise CheckpointError(f"{path} is not a full checkpoint written by fsdp_guide")
    return payload
