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


def parallelize(
    model: nn.Module,
    mesh: Any,
    tp_plan: Mapping[str, str] | None = None,
    *,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Cut each block of ``model.blocks`` over ``mesh["tp"]``, then shard over ``mesh["dp"]``.

    ``tp_plan`` maps a layer's name in a block to ``"colwise"`` or ``"rowwise"``
    (:data:`~fsdp_guide.parallel.TP_PLAN` by default); ``parallelize_module`` applies
    ``ColwiseParallel`` / ``RowwiseParallel``. ``fully_shard`` then shards every block and the
    root over the ``dp`` dimension: each parameter is a ``DTensor`` sharded over both.

    With ``sequence_parallel=True`` the residual stream between the blocks' tensor-parallel
    regions is cut along the sequence (``Shard(1)``) as well: the first block takes its
    ``1 / t`` of the tokens from the embeddings' output, ``SequenceParallel()`` runs each
    block's norms (and the final norm) on those tokens with replicated weights,
    ``PrepareModuleInput`` all-gathers the attention's and the feed-forward's input once
    (one gather feeds ``wq``, ``wk`` and ``wv``, where ``input_layouts=Shard(1)`` on each
    colwise layer would gather three times), the rowwise layers reduce-scatter their output
    back to ``Shard(1)`` instead of all-reducing it, and the head's input is all-gathered,
    so every rank computes the whole logits and the same loss. No parameter is cut further.

    Args:
        model: A model with a ``blocks`` ``ModuleList``, ``norm`` and ``head``, on the
            rank's device.
        mesh: A 2-D mesh with dimensions ``"dp"`` and ``"tp"``, or
            anything that gives the two 1-D meshes by those keys (Lightning's
            ``ModelParallelStrategy`` names them ``"data_parallel"`` and ``"tensor_parallel"``).
        tp_plan: Layer name to ``"colwise"`` / ``"rowwise"``.
        sequence_parallel: Also cut the norms and the residual stream along the sequence.

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
        styled: dict[str, Any] = {k: styles[v]() for k, v in plan.items()}
        if sequence_parallel:
            styled.update(_sequence_parallel_block(block, plan))
        parallelize_module(block, mesh["tp"], styled)
    if sequence_parallel:
        parallelize_module(model, mesh["tp"], _sequence_parallel_root(model))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


#: The norms sequence parallelism runs on a rank's tokens (``SequenceParallel`` supports them).
NORMS = (nn.LayerNorm, nn.RMSNorm)


def _norms(module: nn.Module, skip: str = "") -> list[str]:
    """The names of the norms in ``module``, but for those under ``skip``."""
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, NORMS) and not (skip and name.startswith(skip))
    ]


def _sequence_parallel_block(block: nn.Module, plan: Mapping[str, str]) -> dict[str, Any]:
    """The styles sequence parallelism adds to (or puts in place of) a block's plan: its
    norms, the input of each colwise layers' parent module, its rowwise layers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather() -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    parents = {k.rpartition(".")[0] for k, v in plan.items() if v == "colwise"}
    return {
        **{name: SequenceParallel() for name in _norms(block)},
        # One all-gather of the normed tokens for every colwise layer of the sub-module,
        # kept a DTensor: the input gradients they return (partial sums) are added up
        # and reduce-scattered once, instead of each all-reduced as a plain input's would be.
        **{name: gather() for name in sorted(parents)},
        # Reduce-scatter the partial sums to this rank's tokens instead of all-reducing.
        **{k: RowwiseParallel(output_layouts=Shard(1)) for k, v in plan.items() if v == "rowwise"},
    }


def _sequence_parallel_root(model: nn.Module) -> dict[str, Any]:
    """The styles outside the blocks: into the sequence-cut stream and back out of it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    return {
        # The embeddings are replicated: each rank keeps its slice of the tokens (no message).
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        **{name: SequenceParallel() for name in _norms(model, skip="blocks.")},
        # The head is not cut: gather the tokens, and every rank computes the whole logits.
        "head": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
