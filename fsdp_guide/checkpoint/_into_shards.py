"""Full weights into a sharded model, read by rank 0 only: :func:`load_full_state_dict`.

PyTorch gives the collective half: ``set_model_state_dict(model, state, options=
StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` sends each tensor of
rank 0's full state dict to every rank, which keeps only its shard. What it leaves to the
caller is reading the file on rank 0 alone (a ``torch.save`` file, mapped rather than read,
or a ``.safetensors`` file), checking its bytes first (the SHA-256 a full checkpoint of
:func:`~fsdp_guide.checkpoint.save` carries, else the CRC-32s ``torch.save`` writes),
refusing a file of the wrong keys or shapes on every rank at once instead of hanging the
others in a broadcast, and the ``weights_only`` read.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_guide.checkpoint import _digest
from fsdp_guide.checkpoint._agree import agree, attempt, rank_and_world
from fsdp_guide.checkpoint._io import FULL_FORMAT
from fsdp_guide.errors import CheckpointError, MissingRequirementError

Source = str | os.PathLike[str] | Mapping[str, torch.Tensor]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise MissingRequirementError(
            f"reading {path.name} needs the safetensors package: pip install "
            '"fsdp-guide[safetensors]" (or pip install safetensors)'
        ) from exc
    try:
        return load_file(path, device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError for a bad file
        raise CheckpointError(f"{path} is not a readable .safetensors file: {exc}") from exc


def _read_torch(path: Path) -> Any:
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is truncated or not a torch.save file (not a zip archive); nothing in "
            "it was unpickled"
        )
    # Before anything is unpickled: the stored SHA-256, or in a file without one (any plain
    # torch.save file) the zip's CRC-32s; changed bytes would otherwise load as other weights.
    with warnings.catch_warnings(record=True) as unsealed:
        warnings.simplefilter("always")
        _digest.verify(path)
    try:
        # Mapped, not read: the tensors stay in the file's pages until they are sent.
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refused to load {path}: it carries pickled objects other than tensors and "
            f"plain values, which could run code (weights_only=True). Detail: {exc}"
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is truncated or corrupt: {exc}") from exc
    if isinstance(loaded, Mapping) and loaded.get("format") == FULL_FORMAT:
        for warning in unsealed:  # a full checkpoint saved before digests: say how to add one
            warnings.warn(warning.message, stacklevel=4)
    return loaded


def read_full_state_dict(source: Source) -> dict[str, torch.Tensor]:
    """The full state dict in ``source``, read safely.

    A file's bytes are checked before anything in it is unpickled: against the SHA-256 that a
    full checkpoint of :func:`~fsdp_guide.checkpoint.save` stores in it, or, in a plain
    ``torch.save`` file, against the CRC-32 of each member. A ``.safetensors`` file carries
    no checksum; its header and sizes are checked as it is read.

    Args:
        source: A ``.safetensors`` file; a ``torch.save`` file of a state dict, or of a full
            checkpoint written by :func:`~fsdp_guide.checkpoint.save` (its ``"model"``); or
            a state dict already in memory.

    Returns:
        Parameter and buffer names mapped to CPU tensors.

    Raises:
        CheckpointError: A missing, unreadable or changed file (bytes that do not match its
            digest or checksums), pickled code, or anything but a mapping of names to
            tensors.
        ValueError: ``MissingRequirementError``: A ``.safetensors`` file without the safetensors
            package.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "weights.pt"
        >>> torch.save(nn.Linear(2, 1).state_dict(), path)
        >>> sorted(read_full_state_dict(path))
        ['bias', 'weight']
        >>> torch.save({"weight": [1, 2]}, path)
        >>> read_full_state_dict(path)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: ...weights.pt holds no state dict: 'weight' is a list...
    """
    if isinstance(source, Mapping):
        loaded: Any = source
        where = "the state dict given"
    else:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist; check the path")
        loaded = _read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path)
        if isinstance(loaded, Mapping) and loaded.get("format") == FULL_FORMAT:
            loaded = loaded["model"]  # a full checkpoint of fsdp_guide.checkpoint.save
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{where} holds no state dict but a {type(loaded).__name__}")
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{where} holds no state dict: {key!r} is a {type(value).__name__}, not a "
                "tensor (a training checkpoint? pass its model state dict)"
            )
    return dict(loaded)


def _mismatch(
    given: Mapping[str, torch.Tensor], expected: Mapping[str, Any], strict: bool
) -> str | None:
    """What keeps ``given`` from loading into a model whose state dict is ``expected``."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    shapes = sorted(
        f"{k}: file {tuple(given[k].shape)}, model {tuple(expected[k].shape)}"
        for k in set(given) & set(expected)
        if tuple(given[k].shape) != tuple(expected[k].shape)
    )
    problems = [f"shapes differ ({'; '.join(shapes[:5])})"] if shapes else []
    if strict and missing:
        problems.append(f"missing {len(missing)} key(s), e.g. {missing[:3]}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}")
    if not problems:
        return None
    return "the weights do not fit the model: " + "; ".join(problems)


def load_full_state_dict(
    model: nn.Module, source: Source | None, *, strict: bool = True
) -> dict[str, int]:
    """Load full weights into a sharded model, read by rank 0 alone.

    Collective: every rank calls it with its own model (FSDP2 or FSDP1, or a plain module or
    DDP). Rank 0 reads ``source`` (``read_full_state_dict``: its bytes verified
    first; other ranks may pass ``None``) and checks names and shapes against the model;
    then PyTorch's ``set_model_state_dict(..., full_state_dict=True,
    broadcast_from_rank0=True)`` sends the tensors one by one. Into FSDP2 each rank copies
    its shard out of each as it comes: no rank but 0 holds the whole model. Into FSDP1,
    torch keeps every received tensor until all have come, then loads them through FSDP1's
    full state dict: each rank holds the whole state dict for a while (measured in lesson
    11).

    Args:
        model: The model on this rank.
        source: On rank 0, the file or state dict to load; ignored on other ranks.
        strict: Refuse missing and unexpected keys (shapes must always fit).

    Returns:
        ``{"tensors": n, "bytes": b}`` of what rank 0 read.

    Raises:
        CheckpointError: On every rank, when rank 0 cannot read ``source``, its bytes
            changed since it was written, or it does not fit the model; nothing has been
            loaded then.

    Examples:
        In one process (a plain module):

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "weights.pt"
        >>> torch.save(nn.Linear(2, 1).state_dict(), path)
        >>> load_full_state_dict(nn.Linear(2, 1), path)
        {'tensors': 2, 'bytes': 12}
        >>> load_full_state_dict(nn.Linear(3, 1), path)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: the weights do not fit the model: shapes differ ...
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    rank, world = rank_and_world()
    # Each name with its global shape; collective under FSDP1 (its sharded tensors agree on
    # their layout), so every rank takes it.
    expected = get_model_state_dict(model)
    state: dict[str, Any] = {}
    failure = None
    if rank == 0:

        def read_and_check() -> dict[str, torch.Tensor]:
            if source is None:
                raise CheckpointError("rank 0 needs a source to read: a file or a state dict")
            read = read_full_state_dict(source)
            message = _mismatch(read, expected, strict)
            if message is not None:
                raise CheckpointError(message)
            return read

        read, failure = attempt(read_and_check)
        state = dict(read or {})
    summary = agree(failure, _summary(state) if rank == 0 else None)[0]  # rank 0's
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1, strict=strict)
    set_model_state_dict(model, state, options=options)
    result: dict[str, int] = summary
    return result


def _summary(state: Mapping[str, Any]) -> dict[str, int]:
    tensors = list(state.values())
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors)}
