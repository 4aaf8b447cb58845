"""Tensor parallelism on one mesh dimension, FSDP2 on the other (private)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from fsdp_guide.parallel._model import TP_PLAN


def mesh_2d(dp: int, tp: int, device_type: str = "cpu") -> Any:
    """A ``(dp, tp)`` device mesh, row-major: ranks ``r`` and ``r + 1`` share a ``tp`` group.

    Raises:
        ValueError: When ``dp * tp`` is not the world size.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dp * tp != dist.get_world_size():
        raise ValueError(
            f"a ({dp}, {tp}) mesh needs {dp * tp} ranks, not {dist.get_world_size()}: "
            "launch dp * tp ranks"
        )
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, mesh: Any, tp_plan: Mapping[str, str] | None = None) -> nn.Module:
    """Cut each block of ``model.blocks`` over ``mesh["tp"]``, then shard over ``mesh["dp"]``.

    ``tp_plan`` maps a layer's name in a block to ``"colwise"`` or ``"rowwise"``
    (:data:`~fsdp_guide.parallel.TP_PLAN` by default); ``parallelize_module`` applies
    ``ColwiseParallel`` / ``RowwiseParallel``. ``fully_shard`` then shards every block and the
    root over the ``dp`` dimension: each parameter is a ``DTensor`` sharded over both.

    Args:
        model: A model with a ``blocks`` ``ModuleList``, on the rank's device.
        mesh: A 2-D mesh with dimensions ``"dp"`` and ``"tp"`` (:func:`mesh_2d`), or
            anything that gives the two 1-D meshes by those keys (Lightning's
            ``ModelParallelStrategy`` names them ``"data_parallel"`` and ``"tensor_parallel"``).
        tp_plan: Layer name to ``"colwise"`` / ``"rowwise"``.

    Returns:
        ``model``, parallelized in place.

    Raises:
        ValueError: For a style other than colwise or rowwise.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = dict(tp_plan if tp_plan is not None else TP_PLAN)
    bad = sorted(v for v in plan.values() if v not in styles)
    if bad:
        raise ValueError(f"tp_plan styles must be 'colwise' or 'rowwise', got {bad}")
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tp"], {k: styles[v]() for k, v in plan.items()})
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
