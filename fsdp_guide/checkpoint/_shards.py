"""One rank's shard of the training state, and stitching shards back into a full state.

For PyTorch FSDP1 and FSDP2 the sharded state comes from
:func:`torch.distributed.checkpoint.state_dict.get_state_dict`, whose values are
``ShardedTensor`` (FSDP1) or ``DTensor`` (FSDP2). A shard file keeps only plain tensors:
the rank's local piece of each value, and in ``layout`` the whole tensor's shape and where
the piece starts in it. That is enough to load at the same world size and to consolidate
offline, and the file reads back with ``torch.load(weights_only=True)``. (We do not use
:func:`torch.distributed.checkpoint.save`'s own file format because its ``.metadata`` file is
an unrestricted pickle.)

FairScale FSDP keeps its own local state dict and the metadata its
``consolidate_shard_weights`` needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_guide.checkpoint._names import check_names_and_shapes, shape_of
from fsdp_guide.checkpoint._state import Strategy
from fsdp_guide.errors import CheckpointError

_Layout = dict[str, dict[str, list[int]]]


def _local_piece(value: Any) -> tuple[torch.Tensor, dict[str, list[int]] | None]:
    """The local tensor of a DTensor / ShardedTensor and its place in the whole tensor."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        # Private helper, but the one DCP itself uses to place a DTensor's local piece.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        whole = [int(n) for n in value.shape]
        return value.to_local(), {"shape": whole, "offset": [int(n) for n in offset]}
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        shape = [int(n) for n in value.size()]
        if not shards:  # more ranks than rows: this rank holds nothing of it
            return torch.empty(0), {"shape": shape, "offset": []}
        if len(shards) > 1:
            raise CheckpointError("a ShardedTensor with several local shards is not supported")
        start = [int(n) for n in shards[0].metadata.shard_offsets]
        return shards[0].tensor, {"shape": shape, "offset": start}
    return value, None


def _split(value: Any, path: str, layout: _Layout) -> Any:
    if isinstance(value, dict):
        return {k: _split(v, f"{path}/{k}", layout) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, f"{path}/{i}", layout) for i, v in enumerate(value))
    if isinstance(value, torch.Tensor):
        local, place = _local_piece(value)
        if place is not None:
            layout[path] = place
        return local.detach().to("cpu", copy=True)
    return value


def get_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, strategy: Strategy
) -> dict[str, Any]:
    """This rank's shard of the state, as plain tensors (collective: call on every rank).

    Returns:
        ``{"model", "optimizer", "layout"}``; for FairScale FSDP also ``"metadata"``.

    Raises:
        ValueError: For a strategy that does not shard parameters.

    Examples:
        FSDP2 on a one-rank gloo group (the shard is then the whole tensor):

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fsdp_guide import dist_init, find_free_port
        >>> dist_init(0, 1, master_port=find_free_port())
        >>> model = fully_shard(nn.Linear(4, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> shard = get_sharded_state(model, None, "fsdp2")
        >>> shard["layout"]["model/weight"], type(shard["model"]["weight"]).__name__
        ({'shape': [2, 4], 'offset': [0, 0]}, 'Tensor')
        >>> set_sharded_state(model, None, "fsdp2", shard)
        >>> dist.destroy_process_group()
    """
    if strategy == "fairscale_fsdp":
        return {
            "model": dict(model.local_state_dict()),  # type: ignore[operator]
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "metadata": model.local_metadata_dict(),  # type: ignore[operator]
            "layout": {},
        }
    if strategy not in ("fsdp1", "fsdp2"):
        raise ValueError(f"strategy {strategy!r} has no sharded state")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=False)
    model_state, optim_state = get_state_dict(
        model, [optimizer] if optimizer is not None else [], options=options
    )
    layout: _Layout = {}
    return {
        "model": _split(dict(model_state), "model", layout),
        "optimizer": _split(dict(optim_state), "optimizer", layout) if optimizer else None,
        "layout": layout,
    }


def _leaves(value: Any, path: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{path}/{k}"))
        return out
    return {path: value}


def _copy_into(template: Any, saved: Any, path: str, check_only: bool = False) -> Any:
    """Copy saved local pieces into the live sharded template; plain values are replaced.

    With ``check_only`` nothing is copied: a first pass finds any mismatch before the
    second pass changes a single parameter, so a failed load leaves the model as it was.
    """
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            raise CheckpointError(
                f"{path}: the checkpoint's entries differ from this model's; load with the "
                "same model, optimizer and sharding that saved it"
            )
        return {k: _copy_into(v, saved[k], f"{path}/{k}", check_only) for k, v in template.items()}
    if isinstance(template, torch.Tensor):
        local, _ = _local_piece(template)
        if not isinstance(saved, torch.Tensor) or tuple(local.shape) != tuple(saved.shape):
            found = list(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(
                f"{path}: this rank's shard has shape {list(local.shape)} but the checkpoint's "
                f"has {found}; load with the same sharding that saved it, or consolidate the "
                "checkpoint and load the full one"
            )
        if not check_only:
            with torch.no_grad():
                local.copy_(saved)
        return template
    return saved


def set_sharded_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strategy: Strategy,
    shard: dict[str, Any],
) -> None:
    """Load this rank's shard (from :func:`get_sharded_state`) into a model of the same sharding.

    Raises:
        CheckpointError: Names or shapes differ (the message lists them).

    Examples:
        See :func:`get_sharded_state`.
    """
    if strategy == "fairscale_fsdp":
        model.load_local_state_dict(shard["model"])  # type: ignore[operator]
        if optimizer is not None and shard["optimizer"] is not None:
            optimizer.load_state_dict(shard["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    optimizers = [optimizer] if optimizer is not None else []
    model_live, optim_live = get_state_dict(model, optimizers, options=options)
    layout = shard["layout"]
    saved_shapes = {
        k: tuple(layout[f"model/{k}"]["shape"] if f"model/{k}" in layout else v.shape)
        for k, v in shard["model"].items()
    }
    live_shapes = {k: shape_of(v) for k, v in model_live.items()}
    check_names_and_shapes(live_shapes, saved_shapes)
    optim_saved: dict[str, Any] = {}
    if optimizer is not None and shard["optimizer"] is not None:
        saved_leaves = set(_leaves(shard["optimizer"]["state"], "state"))
        live_leaves = set(_leaves(dict(optim_live)["state"], "state"))
        if saved_leaves != live_leaves:
            check_names_and_shapes(
                dict.fromkeys(live_leaves, ()),
                dict.fromkeys(saved_leaves, ()),
                what="optimizer",
            )
        optim_saved = shard["optimizer"]["state"]
    pairs: list[tuple[Any, Any, str]] = [(dict(model_live), shard["model"], "model")]
    if optim_saved:
        pairs.append((dict(optim_live)["state"], optim_saved, "state"))
    for live, saved, path in pairs:  # every check before the first copy
        _copy_into(live, saved, path, check_only=True)
    model_new = _copy_into(dict(model_live), shard["model"], "model")
    optim_new: dict[str, Any] = {}
    if optim_saved:
        optim_new = {
            "state": _copy_into(dict(optim_live)["state"], optim_saved, "state"),
            "param_groups": shard["optimizer"]["param_groups"],
        }
    set_state_dict(model, optimizers, model_state_dict=model_new, optim_state_dict=optim_new)


def _assemble(pieces: list[tuple[torch.Tensor, dict[str, list[int]]]], path: str) -> torch.Tensor:
    shape = pieces[0][1]["shape"]
    full = torch.empty(shape, dtype=pieces[0][0].dtype)
    covered = 0
    for local, place in pieces:
        if not place["offset"] or local.numel() == 0:
            continue
        index = tuple(
            slice(start, start + size)
            for start, size in zip(place["offset"], local.shape, strict=True)
        )
        full[index] = local
        covered += local.numel()
    if covered != full.numel():
        raise CheckpointError(
            f"{path}: the shards cover {covered} of {full.numel()} elements; a shard is "
            "missing or was saved by a different run"
        )
    return full


def _stitch(value: Any, path: str, shards: list[dict[str, Any]], flat: list[dict[str, Any]]) -> Any:
    if isinstance(value, dict):
        return {k: _stitch(v, f"{path}/{k}", shards, flat) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and path in shards[0]["layout"]:
        try:
            pieces = [
                (leaves[path], s["layout"][path]) for leaves, s in zip(flat, shards, strict=True)
            ]
        except KeyError as exc:
            raise CheckpointError(
                f"{path} is missing from a shard; the shards do not match"
            ) from exc
        return _assemble(pieces, path)
    return value


def consolidate_shards(
    shards: list[dict[str, Any]], strategy: Strategy
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Stitch every rank's shard (ordered by rank) into a full model and optimizer state.

    Runs offline, in one process. The optimizer state is keyed by parameter name, like a
    full checkpoint's. For FairScale FSDP only the model is consolidated (its optimizer
    shards have no offline consolidation), so the optimizer state is ``None``.

    Raises:
        CheckpointError: The shards do not cover every tensor.

    Examples:
        >>> piece = {"shape": [4], "offset": [0]}
        >>> shards = [
        ...     {"model": {"w": torch.tensor([1.0, 2.0])}, "optimizer": None,
        ...      "layout": {"model/w": piece}},
        ...     {"model": {"w": torch.tensor([3.0, 4.0])}, "optimizer": None,
        ...      "layout": {"model/w": {"shape": [4], "offset": [2]}}},
        ... ]
        >>> consolidate_shards(shards, "fsdp2")
        ({'w': tensor([1., 2., 3., 4.])}, None)
    """
    if strategy == "fairscale_fsdp":
        from fairscale.nn.data_parallel import FullyShardedDataParallel

        weights = FullyShardedDataParallel.consolidate_shard_weights(
            [s["model"] for s in shards], [s["metadata"] for s in shards]
        )
        return dict(weights), None
    flat_models = [_leaves(s["model"], "model") for s in shards]
    model_state = _stitch(shards[0]["model"], "model", shards, flat_models)
    optim = shards[0]["optimizer"]
    if optim is None:
        return model_state, None
    flat_optims = [_leaves(s["optimizer"], "optimizer") for s in shards]
    return model_state, _stitch(optim, "optimizer", shards, flat_optims)
