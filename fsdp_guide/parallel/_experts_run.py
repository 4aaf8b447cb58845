"""A launched rank training a transformers mixture of experts with expert parallelism and
FSDP2, and what it measures (private)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_guide.parallel._experts import ExpertParallelMoE, expert_parallelize


def moe_batch(
    vocab_size: int, batch_size: int, seq_len: int, step: int, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Seeded random token ids and targets, the same on every rank.

    Examples:
        >>> ids, targets = moe_batch(32, 4, 8, step=0)
        >>> ids.shape, bool((ids < 32).all())
        (torch.Size([4, 8]), True)
    """
    g = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (batch_size, seq_len)
    return torch.randint(vocab_size, shape, generator=g), torch.randint(
        vocab_size, shape, generator=g
    )


def _build(config: Any) -> nn.Module:
    """The causal LM of a transformers ``config``, with random weights (no download)."""
    import transformers

    model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return model


def _loss(model: nn.Module, ids: Tensor, targets: Tensor) -> Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _shard(model: nn.Module, layers: list[ExpertParallelMoE], mesh: Any) -> None:
    """FSDP2 two ways: each layer's experts over the ranks holding the same experts (none
    when no other rank does), every decoder layer and the root over all ranks."""
    from torch.distributed.fsdp import fully_shard

    ignored: set[nn.Parameter] = set()
    for layer in layers:
        if mesh["efsdp"].size() > 1:
            fully_shard(layer.experts, mesh=mesh["efsdp"])
        else:
            ignored.update(layer.experts.parameters())
    dense = mesh["efsdp", "ep"]._flatten("dp")
    blocks: Any = getattr(model, "model", model).layers
    for block in blocks:
        fully_shard(block, mesh=dense, ignored_params=ignored or None)
    fully_shard(model, mesh=dense, ignored_params=ignored or None)


def _local_numel(param: Tensor) -> int:
    """Elements of ``param`` on this rank: its shard when FSDP2 sharded it."""
    local = getattr(param, "to_local", None)
    return int(local().numel()) if callable(local) else param.numel()


def _average_expert_grads(layers: list[ExpertParallelMoE], ep: int) -> None:
    """An expert's gradient sums the tokens of its whole expert-parallel group, ``ep`` ranks'
    worth, where the dense layers' reduce-scatter averages each rank's: divide by ``ep``
    (FSDP2's ``set_gradient_divide_factor`` would, on NCCL; gloo has no pre-multiplied sum)."""
    for layer in layers:
        for param in layer.experts.parameters():
            if param.grad is not None:
                param.grad.div_(ep)


def train_expert_parallel(
    rank: int,
    world_size: int,
    ep: int,
    config: Any,
    *,
    steps: int = 2,
    batch_size: int = 4,
    seq_len: int = 8,
    capacity_factor: float | None = None,
    lr: float = 1e-2,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Train a transformers causal LM with mixture-of-experts layers (from ``config``) with
    expert parallelism over groups of ``ep`` ranks and FSDP2.

    Each rank takes ``batch_size // world_size`` samples of the global batch. Every MoE
    block becomes an :class:`~fsdp_guide.parallel.ExpertParallelMoE` over its group (ranks
    ``r`` to ``r + ep - 1``); its experts are sharded by FSDP2 over the ``world_size // ep``
    ranks holding the same ones, the rest of the model over all ranks. The last step is
    measured.

    Args:
        rank: This rank (given by :func:`fsdp_guide.launch`).
        world_size: Ranks, a multiple of ``ep``.
        ep: Ranks per expert-parallel group.
        config: A transformers config of a causal LM with grouped experts (``MixtralConfig``,
            ``Qwen2MoeConfig``).
        steps: Optimizer steps.
        batch_size: Global samples per step (divisible by ``world_size``).
        seq_len: Tokens per sample.
        capacity_factor: The layers' capacity (:class:`~fsdp_guide.parallel.ExpertParallelMoE`).
        lr: Adam's learning rate.
        device: This rank's device (:func:`fsdp_guide.launcher.rank_device` by default).

    Returns:
        ``losses``, ``state`` (after the step), ``activations`` (bytes saved by the forward),
        ``collectives`` (payload elements per kind), ``routing`` (each layer's
        ``Routing`` of the last step), ``expert_params`` (the
        experts' elements this rank holds, its shards of them) and ``ep_rank``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_guide.comm import count_collectives
    from fsdp_guide.launcher import rank_device
    from fsdp_guide.memory import measure_model_state
    from fsdp_guide.wrap import saved_activation_bytes

    device = device or rank_device()
    mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = _build(config).to(device)
    layers = expert_parallelize(model, mesh["ep"].get_group(), capacity_factor)
    _shard(model, layers, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    share = batch_size // world_size
    losses = []
    for step in range(steps):
        ids, targets = moe_batch(config.vocab_size, batch_size, seq_len, step)
        rows = slice(rank * share, (rank + 1) * share)
        ids, targets = ids[rows].to(device), targets[rows].to(device)
        with count_collectives() as counter:
            saved, loss = saved_activation_bytes(model, lambda: _loss(model, ids, targets))  # noqa: B023
            loss.backward()  # type: ignore[no-untyped-call]
            _average_expert_grads(layers, ep)
            optimizer.step()
        state = measure_model_state(model, optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "state": state,
        "activations": saved,
        "collectives": counter.stats.elements_by_kind(),
        "routing": [layer.routing for layer in layers],
        "expert_params": sum(
            _local_numel(p) for layer in layers for p in layer.experts.parameters()
        ),
        "ep_rank": mesh["ep"].get_local_rank(),
    }


def reference_moe_losses(
    config: Any, *, steps: int = 2, batch_size: int = 4, seq_len: int = 8, lr: float = 1e-2
) -> list[float]:
    """The losses of the same training in one process, every expert on it, the whole batch."""
    torch.manual_seed(0)
    model = _build(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = _loss(model, *moe_batch(config.vocab_size, batch_size, seq_len, step))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
