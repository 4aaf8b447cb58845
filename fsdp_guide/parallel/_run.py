"""One launched rank of a ``(dp, tp)`` run, and what it measures (private)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fsdp_guide.parallel._apply import mesh_2d, parallelize
from fsdp_guide.parallel._model import ParallelConfig, ParallelTransformer


def token_batch(
    config: ParallelConfig, batch_size: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random tokens and targets of ``batch_size`` samples, the same on every rank.

    Examples:
        >>> tokens, targets = token_batch(ParallelConfig(), 4, step=0)
        >>> tokens.shape, targets.shape
        (torch.Size([4, 16]), torch.Size([4, 16]))
    """
    g = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (batch_size, config.seq_len)
    return (
        torch.randint(config.vocab_size, shape, generator=g),
        torch.randint(config.vocab_size, shape, generator=g),
    )


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits."""
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_2d(
    rank: int,
    world_size: int,
    dp: int,
    tp: int,
    *,
    steps: int = 2,
    batch_size: int = 8,
    config: ParallelConfig | None = None,
    lr: float = 1e-2,
    device: torch.device | None = None,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """Train :class:`~fsdp_guide.parallel.ParallelTransformer` on a ``(dp, tp)`` mesh.

    Each data-parallel group gets ``batch_size // dp`` samples of the global batch; the ranks
    of a tensor-parallel group share them. The last step is measured: the activations
    autograd saves, every collective by kind and group, and the model state after the step.

    Args:
        rank: This rank (given by :func:`fsdp_guide.launch`).
        world_size: ``dp * tp``.
        dp: Data-parallel degree (FSDP2 shards over it).
        tp: Tensor-parallel degree.
        steps: Optimizer steps.
        batch_size: Global samples per step (divisible by ``dp``).
        config: The model's sizes.
        lr: Adam's learning rate.
        device: This rank's device (:func:`fsdp_guide.launcher.rank_device` by default).
        sequence_parallel: Cut the norms and the residual stream along the sequence too
            (:func:`~fsdp_guide.parallel.parallelize`); ``config.seq_len`` must divide by
            ``tp``.

    Raises:
        ValueError: ``sequence_parallel=True`` with ``tp < 2`` or a sequence that does not
            divide by ``tp``.

    Returns:
        ``losses`` (this rank's, per step), ``state`` (a
        ``ModelState``), ``activations`` (bytes), ``collectives``
        (payload bytes per kind) and ``dp_rank``, ``tp_rank``.
    """
    from fsdp_guide.comm import count_collectives
    from fsdp_guide.launcher import rank_device
    from fsdp_guide.memory import measure_model_state
    from fsdp_guide.wrap import saved_activation_bytes

    device = device or rank_device()
    config = config or ParallelConfig()
    if sequence_parallel and (tp < 2 or config.seq_len % tp):
        raise ValueError(
            f"sequence_parallel=True gives each of tp={tp} ranks seq_len / tp tokens: it needs "
            f"tp >= 2 and a config.seq_len ({config.seq_len}) divisible by tp"
        )
    torch.manual_seed(0)
    model = ParallelTransformer(config).to(device)
    mesh = mesh_2d(dp, tp, device.type)
    parallelize(model, mesh, sequence_parallel=sequence_parallel)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    share = batch_size // dp
    losses, activations = [], 0
    for step in range(steps):
        tokens, targets = token_batch(config, batch_size, step)
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        tokens, targets = tokens[rows].to(device), targets[rows].to(device)
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
    return {
        "losses": losses,
        "state": state,
        "activations": activations,
        "collectives": {k: c.bytes for k, c in counter.stats.kinds.items()},
        "dp_rank": dp_rank,
        "tp_rank": tp_rank,
    }


def reference_losses(
    steps: int = 2,
    batch_size: int = 8,
    config: ParallelConfig | None = None,
    lr: float = 1e-2,
) -> list[float]:
    """The losses of the same training in one process, unsharded, on the whole batch."""
    config = config or ParallelConfig()
    torch.manual_seed(0)
    model = ParallelTransformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, *token_batch(config, batch_size, step))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
