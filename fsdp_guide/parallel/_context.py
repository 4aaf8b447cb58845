"""Context parallelism on :class:`~fsdp_guide.parallel.ParallelTransformer`, and a launched
rank that measures it (private).

:func:`context_parallelize` turns each block's attention into ring attention over a group of
ranks and gives the position embeddings the global positions of the rank's tokens; each rank
then runs the model on its share of every sequence (:func:`~fsdp_guide.parallel.shard_sequence`).
FSDP2 shards the weights over every rank, the ranks of a context-parallel group included:
they hold the same weights and compute gradients on different tokens, so to FSDP they are
data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fsdp_guide.parallel._model import Attention, ParallelConfig, ParallelTransformer
from fsdp_guide.parallel._ring import ring_attention
from fsdp_guide.parallel._ring_layout import Layout, shard_sequence


class RingSelfAttention(nn.Module):
    """An ``Attention`` whose attention runs round a ring of ranks.

    It keeps the layers of the attention it replaces (``wq``, ``wk``, ``wv``, ``wo``: the same
    parameters, under the same names) and computes causal :func:`ring_attention` over
    ``group`` with the sequence cut as ``layout`` says.
    """

    def __init__(self, attention: Attention, group: Any, layout: Layout) -> None:
        super().__init__()
        self.head_dim = attention.head_dim
        self.wq, self.wk, self.wv, self.wo = attention.wq, attention.wk, attention.wv, attention.wo
        self.group = group
        self.layout: Layout = layout

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in self._qkv())
        out = ring_attention(q, k, v, causal=True, layout=self.layout, group=self.group)
        result: Tensor = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return result

    def _qkv(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.wq, self.wk, self.wv


def context_parallelize(
    model: ParallelTransformer, group: Any, layout: Layout = "zigzag"
) -> ParallelTransformer:
    """Make ``model`` compute one rank's share of each sequence, its attention a ring.

    Each block's attention becomes a :class:`RingSelfAttention` over ``group`` (the same
    parameters), and the position embedding looks up the global position of each of the
    rank's tokens (:func:`~fsdp_guide.parallel.shard_sequence` of the positions). Feed the
    model ``shard_sequence(tokens, rank, ranks, layout)``.

    Args:
        model: The model, on the rank's device.
        group: The context-parallel ranks (a process group).
        layout: ``"naive"`` or ``"zigzag"`` (balanced causal work).

    Returns:
        ``model``, changed in place.
    """
    import torch.distributed as dist

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    for block in model.blocks:
        attention = block.attention
        assert isinstance(attention, Attention)
        block.attention = RingSelfAttention(attention, group, layout)
    positions = torch.arange(model.config.seq_len, device=model.pos_emb.weight.device)
    mine = shard_sequence(positions, rank, ranks, layout, dim=0)

    def to_global(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (mine[args[0]], *args[1:])  # the i-th local token sits at position mine[i]

    model.pos_emb.register_forward_pre_hook(to_global)
    return model


def _mesh(dp: int, cp: int, tp: int, device_type: str) -> tuple[Any, Any]:
    """A ``(dp, cp, tp)`` mesh, row-major, and its ``dp`` and ``cp`` dimensions flattened
    into one, FSDP's: the ranks that hold the same tensor-parallel shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dp * cp * tp != dist.get_world_size():
        raise ValueError(f"a ({dp}, {cp}, {tp}) mesh needs {dp * cp * tp} ranks")
    mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


def train_context_parallel(
    rank: int,
    world_size: int,
    cp: int,
    *,
    tp: int = 1,
    layout: Layout = "zigzag",
    steps: int = 2,
    batch_size: int = 4,
    config: ParallelConfig | None = None,
    lr: float = 1e-2,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Train :class:`~fsdp_guide.parallel.ParallelTransformer` with context parallelism.

    The ranks form a ``(dp, cp, tp)`` mesh, ``dp = world_size // (cp * tp)``: each
    data-parallel group takes ``batch_size // dp`` samples of the global batch, each rank of
    a context-parallel group its share of their tokens (``layout``), and tensor parallelism
    (``tp > 1``) cuts the blocks' layers as :func:`~fsdp_guide.parallel.parallelize` does.
    FSDP2 shards every block and the root over the ``dp x cp`` ranks. The last step is
    measured: the activations autograd saves, every collective and point-to-point message
    by kind, and the model state after the step.

    Args:
        rank: This rank (given by :func:`fsdp_guide.launch`).
        world_size: ``dp * cp * tp``.
        cp: Ranks per context-parallel group (the ring).
        tp: Ranks per tensor-parallel group.
        layout: How the sequence is cut: ``"naive"`` or ``"zigzag"``.
        steps: Optimizer steps.
        batch_size: Global samples per step (divisible by ``dp``).
        config: The model's sizes (``seq_len`` divisible by ``cp``, or ``2 * cp`` for
            ``"zigzag"``).
        lr: Adam's learning rate.
        device: This rank's device (:func:`fsdp_guide.launcher.rank_device` by default).

    Returns:
        ``losses`` (this rank's, per step), ``state`` (a
        ``ModelState``), ``activations`` (bytes), ``collectives``
        (payload bytes per kind, ``send`` and ``recv`` included), ``sent`` (the elements of
        the ring's messages) and ``dp_rank``, ``cp_rank``, ``tp_rank``.
    """
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.comm import count_collectives
    from fsdp_guide.launcher import rank_device
    from fsdp_guide.memory import measure_model_state
    from fsdp_guide.parallel._model import TP_PLAN
    from fsdp_guide.parallel._run import loss_of, token_batch
    from fsdp_guide.wrap import saved_activation_bytes

    device = device or rank_device()
    config = config or ParallelConfig()
    dp = world_size // (cp * tp)
    mesh, fsdp_mesh = _mesh(dp, cp, tp, device.type)
    torch.manual_seed(0)
    model = ParallelTransformer(config).to(device)
    if tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    context_parallelize(model, mesh["cp"].get_group(), layout)
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    ranks = {name: mesh[name].get_local_rank() for name in ("dp", "cp", "tp")}
    share = batch_size // dp
    losses, activations = [], 0
    for step in range(steps):
        tokens, targets = token_batch(config, batch_size, step)
        rows = slice(ranks["dp"] * share, (ranks["dp"] + 1) * share)
        tokens, targets = (
            shard_sequence(t[rows], ranks["cp"], cp, layout).to(device) for t in (tokens, targets)
        )
        with count_collectives() as counter:
            activations, loss = saved_activation_bytes(
                model,
                lambda: loss_of(model, tokens, targets),  # noqa: B023 (called at once)
            )
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        state = measure_model_state(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    kinds = counter.stats.kinds
    return {
        "losses": losses,
        "state": state,
        "activations": activations,
        "collectives": {k: c.bytes for k, c in kinds.items()},
        "sent": kinds["send"].elements if "send" in kinds else 0,
        "dp_rank": ranks["dp"],
        "cp_rank": ranks["cp"],
        "tp_rank": ranks["tp"],
    }
