"""One launched rank of a pipeline on a ``(pp, dp)`` mesh, and what it measures (private)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_guide.parallel._model import ParallelConfig, ParallelTransformer
from fsdp_guide.parallel._pipeline import build_pipeline
from fsdp_guide.parallel._run import token_batch


def _mesh(pp: int, dp: int, device: torch.device) -> tuple[Any, Any, int]:
    """The pipeline's process group, the data-parallel mesh (or ``None``) and the dp rank."""
    if dp == 1:
        return None, None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return mesh["pp"].get_group(), mesh["dp"], mesh["dp"].get_local_rank()


def train_pipeline(
    rank: int,
    world_size: int,
    *,
    schedule: str = "1F1B",
    microbatches: int = 4,
    dp: int = 1,
    stages_per_rank: int | None = None,
    steps: int = 2,
    batch_size: int = 8,
    config: ParallelConfig | None = None,
    model: Callable[[], nn.Module] | None = None,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    lr: float = 1e-2,
    device: torch.device | None = None,
    measure: bool = True,
) -> dict[str, Any]:
    """Train a model cut into pipeline stages on ``world_size // dp`` pipeline ranks.

    The ranks form a ``(pp, dp)`` mesh, row-major: ranks ``0 .. dp - 1`` hold the first
    stages. Each data-parallel group takes ``batch_size // dp`` samples of the global batch
    and its pipeline splits them into ``microbatches``; with ``dp > 1`` each stage is sharded
    with FSDP2 over its ``dp`` ranks (:func:`~fsdp_guide.parallel.build_pipeline`). The last
    step is measured: the bytes autograd holds at its fullest (parameters left out), every
    collective and message by kind, the model state after the optimizer's step, and when each
    action ran.

    Args:
        rank: This rank (given by :func:`fsdp_guide.launch`).
        world_size: ``pp * dp``.
        schedule: torch's schedule name (``"GPipe"``, ``"1F1B"``, ...).
        microbatches: Micro-batches per step.
        dp: Data-parallel ranks per stage.
        stages_per_rank: Stages per pipeline rank (by default the schedule's).
        steps: Optimizer steps.
        batch_size: Global samples per step (divisible by ``dp * microbatches``).
        config: The sizes of the default model, a
            :class:`~fsdp_guide.parallel.ParallelTransformer` built with seed 0.
        model: Builds the model instead (called after ``torch.manual_seed(0)``).
        batch: ``batch(step)``: the global batch of a step (default: seeded random tokens,
            :func:`~fsdp_guide.parallel.token_batch`).
        lr: Adam's learning rate.
        device: This rank's device (:func:`fsdp_guide.launcher.rank_device` by default).
        measure: Measure the last step's bytes; ``False`` only times it, so that neither
            the activation tracking nor the collective counter's dispatch slows the actions
            (then ``activations`` is 0 and ``collectives`` empty).

    Returns:
        ``losses`` (the mean loss of each step on the ranks holding the last stage, else
        empty), ``state`` (a ``ModelState``), ``activations``
        (bytes), ``collectives`` (payload bytes per kind), ``timeline`` (the last step's
        ``(action, start, end)``), ``timelines`` (every step's, the first one setting the
        pipeline up), ``grads`` (with ``dp == 1``: the last step's gradient of
        each of the rank's parameters, by its name in the whole model), ``pp_rank``,
        ``dp_rank`` and ``stages``.
    """
    import torch.distributed as dist

    from fsdp_guide.comm import count_collectives
    from fsdp_guide.launcher import rank_device
    from fsdp_guide.memory import measure_model_state

    device = device or rank_device()
    config = config or ParallelConfig()
    pp = world_size // dp
    group, dp_mesh, dp_rank = _mesh(pp, dp, device)
    torch.manual_seed(0)
    built = model() if model is not None else ParallelTransformer(config)
    pipeline = build_pipeline(
        built.to(device),
        schedule=schedule,
        microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        group=group,
        dp_mesh=dp_mesh,
        device=device,
    )
    optimizer = torch.optim.Adam(pipeline.modules.parameters(), lr=lr)
    names = {id(p): name for name, p in built.named_parameters()}
    share = batch_size // dp
    losses, grads, timelines = [], {}, []
    for step in range(steps):
        inputs, targets = (
            batch(step) if batch is not None else token_batch(config, batch_size, step)
        )
        rows = slice(dp_rank * share, (dp_rank + 1) * share)
        # Copies: a data loader gives each group a batch of its own, not views of a global one.
        inputs, targets = inputs[rows].clone().to(device), targets[rows].clone().to(device)
        last = step == steps - 1
        if last:
            dist.barrier()  # the ranks start the measured step together
        counting = count_collectives() if measure else contextlib.nullcontext()
        with counting as counter:
            loss = pipeline.step(inputs, targets, activations=last and measure)
            if last and dp == 1:
                grads = {
                    names[id(p)]: p.grad.clone()
                    for p in pipeline.modules.parameters()
                    if p.grad is not None
                }
            optimizer.step()
        timelines.append(list(pipeline.timeline))
        if loss is not None:
            losses.append(loss)
        state = measure_model_state(pipeline.modules, optimizer)
        optimizer.zero_grad()
    sent = {k: c.bytes for k, c in counter.stats.kinds.items()} if counter is not None else {}
    return {
        "losses": losses,
        "state": state,
        "activations": pipeline.activations,
        "collectives": sent,
        "grads": grads if dp == 1 else {},
        "timeline": pipeline.timeline,
        "timelines": timelines,
        "pp_rank": pipeline.rank,
        "dp_rank": dp_rank,
        "stages": pipeline.actions.rank_stages(pipeline.rank),
    }
