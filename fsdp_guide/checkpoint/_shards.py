"""A sharded checkpoint's state: written and read per rank, and made whole offline.

PyTorch FSDP1 and FSDP2 take their sharded state from
:func:`torch.distributed.checkpoint.state_dict.get_state_dict` (``ShardedTensor`` or
``DTensor`` values keyed by parameter name) and write it with DCP
(``fsdp_guide/checkpoint/_dcp.py``), which records where every piece lies in its whole
tensor. A load reads the pieces this rank's sharding needs, whatever the world size and
sharding that saved them: FSDP1 and FSDP2 load each other's checkpoints, and a plain module
or DDP reads whole tensors from one. The load goes into a copy of this rank's state (on its
device) and is applied with ``set_state_dict`` only once every read succeeded, so a failed
load leaves the model as it was; the copy costs one more sharded state per rank meanwhile.

FairScale FSDP keeps its own local state dict and the metadata its
``consolidate_shard_weights`` needs, one ``rank<N>.pt`` per rank, loadable only at the world
size that saved it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fsdp_guide.checkpoint import _dcp
from fsdp_guide.checkpoint._agree import agree, attempt, rank_and_world
from fsdp_guide.checkpoint._deepspeed import consolidate_fp32, deepspeed_writer, load_engine
from fsdp_guide.checkpoint._dir import Opened, shard_name
from fsdp_guide.checkpoint._io import atomic_write_torch, read_torch
from fsdp_guide.checkpoint._names import check_names_and_shapes, optimizer_record, shape_of
from fsdp_guide.engines import Engine, engine_class, without_state
from fsdp_guide.errors import CheckpointError

Writer = Callable[[Path], list[str]]


def sharded_writer(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, engine: Engine
) -> tuple[dict[str, Any], Writer]:
    """Take this rank's sharded state now (collective) and say how to write it.

    The engine's layout decides the files: DCP's for ``"dcp"``, one file per rank for
    ``"rank_files"``, DeepSpeed's own for ``"deepspeed"``.

    Returns:
        ``(header, write)`` for :func:`fsdp_guide.checkpoint._dir.write_sharded`: what the
        index records (``strategy``, ``layout``, ``optimizer``), and the writer.

    Raises:
        ValueError: For an engine that does not shard parameters.
    """
    rank, world = rank_and_world()
    if engine.sharded_layout == "deepspeed":
        return deepspeed_writer(model, optimizer)
    state = engine.sharded_state(model, optimizer)
    saved = state.get("optimizer")
    record = optimizer_record(optimizer, saved["state"] if saved else None)
    header = {"strategy": engine.name, "layout": engine.sharded_layout, "optimizer": record}
    if engine.sharded_layout == "rank_files":

        def write_rank_file(data: Path) -> list[str]:
            atomic_write_torch(data / shard_name(rank), state)
            return [shard_name(rank)]

        return header, write_rank_file

    def write_dcp(data: Path) -> list[str]:
        files = _dcp.save(data, state)  # collective; DCP agrees on failures itself
        return files[rank::world]  # each file hashed by one rank

    return header, write_dcp


def _saved_leaves(metadata: Metadata) -> dict[tuple[str | int, ...], tuple[int, ...]]:
    """Key path of every saved value, with its whole shape (``()`` for a non-tensor)."""
    mappings = metadata.planner_data or {}
    return {
        mappings.get(fqn, (fqn,)): (
            tuple(item.size) if isinstance(item, TensorStorageMetadata) else ()
        )
        for fqn, item in metadata.state_dict_metadata.items()
    }


def _check_against_metadata(state: dict[str, Any], metadata: Metadata) -> None:
    """Raise when ``state`` (model, optimizer) wants what the checkpoint does not hold."""
    leaves = _saved_leaves(metadata)
    saved_model = {
        str(p[1]): shape for p, shape in leaves.items() if len(p) == 2 and p[0] == "model"
    }
    live_model = {
        k: shape_of(v) if isinstance(v, torch.Tensor) else () for k, v in state["model"].items()
    }
    check_names_and_shapes(live_model, saved_model)
    if "optimizer" not in state:
        return
    saved_params = {str(p[2]) for p in leaves if len(p) > 2 and p[:2] == ("optimizer", "state")}
    live_params = set(state["optimizer"]["state"])
    if saved_params and saved_params != live_params:
        check_names_and_shapes(
            dict.fromkeys(live_params, ()),
            dict.fromkeys(saved_params, ()),
            what="optimizer's parameters",
        )
    saved_groups = len(
        {p[2] for p in leaves if len(p) > 2 and p[:2] == ("optimizer", "param_groups")}
    )
    if saved_groups != len(state["optimizer"]["param_groups"]):
        raise CheckpointError(
            f"the checkpoint's optimizer has {saved_groups} parameter groups and this one "
            f"{len(state['optimizer']['param_groups'])}; build the optimizer with the same "
            "groups as when saving"
        )
    if not saved_params:  # saved before the first step: the groups are all there is
        state["optimizer"] = without_state(state["optimizer"])


def _loading_copy(value: Any) -> Any:
    """A copy of a state dict to load into: same structure, sharding and device."""
    if isinstance(value, dict):
        return {k: _loading_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_loading_copy(v) for v in value]
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    if isinstance(value, ShardedTensor):
        return copy.deepcopy(value)  # its local shards and their global metadata
    if isinstance(value, torch.Tensor):  # DTensor included: local piece and placements
        return value.detach().clone()
    return value


def _load_dcp(
    data: Path,
    metadata: Metadata,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    optimizers = [optimizer] if optimizer is not None else []
    fresh = optimizer is not None and not optimizer.state
    try:
        # get_state_dict steps a fresh optimizer once (lr 0, zero gradients) to create state.
        model_live, optim_live = get_state_dict(model, optimizers, options=options)
        state: dict[str, Any] = {"model": dict(model_live)}
        if optimizer is not None:
            state["optimizer"] = dict(optim_live)
        _, failure = attempt(lambda: _check_against_metadata(state, metadata))
        agree(failure)
        target = _loading_copy(state)
        _, failure = attempt(lambda: _dcp.load(data, target, metadata))
        agree(failure)
    except BaseException:
        if optimizer is not None and fresh:
            optimizer.state.clear()  # as it was before get_state_dict
        raise
    set_state_dict(
        model,
        optimizers,
        model_state_dict=target["model"],
        optim_state_dict=target.get("optimizer", {}),
        options=options,
    )
    if optimizer is not None and not target["optimizer"]["state"]:
        optimizer.state.clear()  # saved before its first step: fresh, as it was then


def load_sharded_state(
    path: Path,
    opened: Opened,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    engine: Engine,
) -> None:
    """Load a checked sharded checkpoint into this rank's model (collective).

    Raises:
        CheckpointError: On every rank: names, shapes or parameter groups differ (listed),
            or a file failed to read.
    """
    index = opened.index
    if opened.metadata is not None:
        _load_dcp(path / index["metadata"].split("/")[0], opened.metadata, model, optimizer)
        return
    if index.get("layout") == "deepspeed":
        data = path / index["extra"].split("/")[0]
        _, failure = attempt(lambda: load_engine(data, index, model, optimizer))
        agree(failure)
        return
    rank, _ = rank_and_world()
    shard, failure = attempt(lambda: read_torch(path / index["shards"][rank]))
    agree(failure)
    assert shard is not None
    engine.load_rank_file(model, optimizer, shard)


def consolidate_state(path: Path, opened: Opened) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The whole model and optimizer state of a checked sharded checkpoint, in this process.

    The optimizer state is keyed by parameter name, like a full checkpoint's. For FairScale
    FSDP only the model is consolidated (its optimizer shards have no offline
    consolidation), so the optimizer state is ``None``.

    Raises:
        CheckpointError: A file could not be read or was refused.
    """
    index = opened.index
    if opened.metadata is not None:
        data = path / index["metadata"].split("/")[0]
        whole = _dcp.load_everything(data, opened.metadata)
        return whole.get("model", {}), whole.get("optimizer")
    if index.get("layout") == "deepspeed":  # the fp32 master weights; no optimizer state
        data = path / index["extra"].split("/")[0]
        files = [name for name in index["files"] if name != index["extra"]]
        return consolidate_fp32(data, files), None
    shards = [read_torch(path / name) for name in index["shards"]]
    return engine_class(index["strategy"]).consolidate_rank_files(shards), None
