"""DeepSpeed engines in the sharded checkpoint directory: layout ``"deepspeed"`` (private).

The shards are DeepSpeed's own files, written by ``engine.save_checkpoint`` into the fresh
``data-<id>`` directory under the tag :data:`TAG`, and read back by
``engine.load_checkpoint``. What this module adds is the guide's guarantees:

* A rank whose write fails does not raise inside ``save_checkpoint``, whose barriers the
  other ranks would wait at until the process-group timeout: the failure is recorded, the
  rank goes on to the barriers, and every rank then raises it together
  (:func:`~fsdp_guide.checkpoint._agree.agree`). The previous checkpoint stays, since the
  index is replaced only after every rank wrote.
* Every file is read with ``torch.load(weights_only=True)``, allowing only the three plain
  DeepSpeed records a ZeRO checkpoint holds (:func:`safe_globals`), never a full unpickle.
* Each rank reports the files it wrote, so the index records each file's size and SHA-256.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_guide.checkpoint._io import read_torch
from fsdp_guide.engines import engine_class
from fsdp_guide.errors import CheckpointError

#: The DeepSpeed tag: none, so its files lie directly in the data directory, as the index
#: expects of every layout.
TAG = ""


def safe_globals() -> list[Any]:
    """The DeepSpeed classes a ZeRO checkpoint pickles, allowed in a ``weights_only`` load.

    Plain records: the loss scaler's settings, the ZeRO stage enum, and the address of a
    parameter's fragment in a flat partition. Nothing that runs code when built.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def _safe_torch_load() -> Any:
    """Make ``torch.load`` inside DeepSpeed refuse code-carrying pickles, as :func:`read_torch`.

    DeepSpeed's loaders (its checkpoint engine, ``zero_to_fp32``) pass
    ``weights_only=False``; here it is forced to ``True`` with :func:`safe_globals` allowed.
    """
    original = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(safe_globals()):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def deepspeed_writer(
    engine: nn.Module, optimizer: Any
) -> tuple[dict[str, Any], Callable[[Path], list[str]]]:
    """``(header, write)`` for :func:`~fsdp_guide.checkpoint._dir.write_sharded`.

    ``write`` runs ``engine.save_checkpoint`` into the data directory (collective), with
    each rank's file writes caught, flushed and recorded, and returns the files this rank
    wrote (relative to the data directory).
    """
    ds_engine: Any = engine
    # DeepSpeed checks its own optimizer state on load; the stage must match to load at all.
    header = {
        "strategy": "deepspeed",
        "layout": "deepspeed",
        "zero_stage": int(ds_engine.zero_optimization_stage()),
        "optimizer": None if optimizer is None else {"class": type(optimizer).__name__},
    }

    def write(data: Path) -> list[str]:
        written: list[str] = []
        failures: list[BaseException] = []
        checkpoint_engine = ds_engine.checkpoint_engine
        save = checkpoint_engine.save

        def save_caught(state_dict: Any, path: str) -> None:
            try:
                save(state_dict, path)
                _fsync(path)
                written.append(str(Path(path).relative_to(data)))
            except Exception as exc:  # raised below, after DeepSpeed's barriers
                failures.append(exc)

        checkpoint_engine.save = save_caught
        try:
            ds_engine.save_checkpoint(str(data), tag=TAG, client_state={}, save_latest=False)
        finally:
            del checkpoint_engine.save  # the instance attribute; the class's method again
        if failures:
            raise failures[0]
        return written

    return header, write


def check_fits(path: Path, index: dict[str, Any], strategy: str, world: int) -> None:
    """Raise unless a DeepSpeed checkpoint loads into this model at this world size.

    The ZeRO stage is checked on load, against the engine (:func:`load_engine`).
    """
    if engine_class(strategy).sharded_layout != "deepspeed":
        raise CheckpointError(
            f"{path} holds DeepSpeed shards, which load only into a DeepSpeed engine; this model "
            f"is {strategy!r}: consolidate it (python -m fsdp_guide consolidate {path} FILE) and "
            "load the full file's model"
        )
    if index["world_size"] != world:
        raise CheckpointError(
            f"{path} holds DeepSpeed shards saved on {index['world_size']} ranks, and this run "
            f"has {world}: they load at the world size that saved them; consolidate it "
            f"(python -m fsdp_guide consolidate {path} FILE) for the model at any other"
        )


def load_engine(data: Path, index: dict[str, Any], engine: nn.Module, optimizer: Any) -> None:
    """``engine.load_checkpoint`` from a checked data directory (collective).

    Raises:
        CheckpointError: Another ZeRO stage saved it, or DeepSpeed found nothing to load.
    """
    ds_engine: Any = engine
    stage = int(ds_engine.zero_optimization_stage())
    saved = index.get("zero_stage")
    if saved != stage:
        raise CheckpointError(
            f"{data.parent} holds DeepSpeed ZeRO-{saved} shards and this engine is ZeRO-{stage}: "
            "build the engine with the stage that saved it, or consolidate the checkpoint"
        )
    with _safe_torch_load():
        loaded, _ = ds_engine.load_checkpoint(
            str(data),
            tag=TAG,
            load_optimizer_states=optimizer is not None,
            load_lr_scheduler_states=False,
            load_module_only=optimizer is None,
        )
    if loaded is None:
        raise CheckpointError(f"DeepSpeed loaded no checkpoint from {data}")


def consolidate_fp32(data: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """The whole fp32 model state of a DeepSpeed checkpoint, with DeepSpeed's ``zero_to_fp32``.

    Every file is first read with ``weights_only=True`` (:func:`read_torch` semantics plus
    :func:`safe_globals`), so a file carrying code is refused before DeepSpeed reads it.

    Args:
        data: The data directory holding the tag directory.
        files: The data files the index lists (to pre-check).

    Returns:
        Parameter name to fp32 tensor, as in the unwrapped model's ``state_dict()``.
    """
    from fsdp_guide.deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with torch.serialization.safe_globals(safe_globals()):
        for name in files:
            read_torch(data.parent / name)
    # DeepSpeed narrates the conversion (prints and progress bars): our caller reports it.
    quiet = io.StringIO()
    with _safe_torch_load(), redirect_stdout(quiet), redirect_stderr(quiet):
        state = get_fp32_state_dict_from_zero_checkpoint(str(data), tag=TAG)
    return {name: tensor.detach().clone() for name, tensor in state.items()}
