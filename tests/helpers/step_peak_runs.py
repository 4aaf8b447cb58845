"""Measure the peak of one training step per configuration, and plan it (timeline tests)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_guide.deepspeed import backward_and_step, is_engine
from fsdp_guide.engines import wrap_for_strategy
from fsdp_guide.memory import measure_model_state, plan
from fsdp_guide.models import (
    Block,
    TinyTransformer,
    TransformerConfig,
    build_model,
    loss_fn,
    shard_batch,
    synthetic_batch,
)
from fsdp_guide.timeline import record_step
from fsdp_guide.wrap import LayerPolicy, checkpoint_layers, shard

# A run: (catalog strategy, the adapter's settings), each built as a lesson builds it.
Run = tuple[str, dict[str, Any]]


def demo(config: TransformerConfig | None = None) -> torch.nn.Module:
    """The demo transformer (of ``config``), seeded as :func:`build_model` seeds it."""
    if config is None:
        return build_model("transformer")
    torch.manual_seed(0)
    return TinyTransformer(config)


def build(
    strategy: str,
    settings: dict[str, Any],
    checkpointing: bool = False,
    world_size: int = 2,
    config: TransformerConfig | None = None,
) -> tuple[torch.nn.Module, Any]:
    """The demo transformer wrapped for ``strategy``, and its Adam; with ``checkpointing``,
    each ``Block`` checkpointed first (PyTorch's non-reentrant wrapper, as lessons do)."""
    model = demo(config)
    if checkpointing:
        checkpoint_layers(model, Block)
    if strategy == "deepspeed_zero3":  # the engine and its optimizer, as the package trains it
        return wrap_for_strategy(model, strategy, world_size=world_size)
    if strategy in ("ddp", "zero1"):
        # The adapter's bucket setting (``True`` unless the run says ``False``, torch's default).
        view = settings.get("gradient_as_bucket_view", True)
        model = DDP(model, gradient_as_bucket_view=view)
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return model, ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
            )
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    options = dict(settings)
    if strategy == "fsdp" and "backward_prefetch" in options:  # the adapter's name, FSDP1's enum
        from torch.distributed.fsdp import BackwardPrefetch

        name = options["backward_prefetch"]
        options["backward_prefetch"] = BackwardPrefetch[name] if name else None
    engine = "fsdp1" if strategy == "fsdp" else strategy
    model = shard(model, engine=engine, policy=LayerPolicy(Block), **options)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


# Gloo's worker threads let go of a collective's buffers after their work has run, where the
# profiler does not follow them: such a buffer looks held to the end of the step, and now and
# then into its peak. A step where that happened shows it in ``unreleased``. Each run is
# measured up to this many times; the tests take the attempt (on any rank) that lost fewest
# releases.
ATTEMPTS = 3
# What a step that lost no release still shows as unreleased: the loss, held by record_step
# to its end (4 bytes). Once an attempt on some rank is that clean, the run's later attempts
# could only tie with it, and the ranks move on to the next run together.
CLEAN = 64

# One attempt: (bytes whose release went unseen, the peak, the phase of the peak).
Attempt = tuple[int, int, str]


def measure_peaks(
    rank: int,
    world_size: int,
    runs: list[Run],
    batch: int,
    attempts: int = ATTEMPTS,
    checkpointing: bool = False,
    config: TransformerConfig | None = None,
) -> list[list[Attempt]]:
    """For each run, up to ``attempts`` measurements of a steady step, each on a model built
    afresh: fewer when an attempt on some rank lost no release (``CLEAN``).

    The first step creates Adam's state. DDP rebuilds its buckets at the start of the second
    forward: new ones allocated under the profiler, the old ones (allocated before it)
    released unseen, so that step would count the buckets twice; DDP's third step is measured.
    """
    warnings.filterwarnings("ignore")
    out = []
    for strategy, settings in runs:
        tries = []
        # DeepSpeed's Python hooks make a profiled step slow; its peak varied by 8 bytes
        # over attempts (the gathered parameters dwarf gloo's lost releases): one will do.
        for _ in range(1 if strategy == "deepspeed_zero3" else attempts):
            model, optimizer = build(strategy, settings, checkpointing, world_size, config)
            whole = synthetic_batch("transformer", batch, config=config)
            data = shard_batch(whole, rank, world_size)
            for _ in range(2 if isinstance(model, DDP) else 1):
                backward_and_step(model, optimizer, loss_fn(model, data))
                optimizer.zero_grad()
            state = measure_model_state(model, optimizer)
            # A DeepSpeed engine runs its own backward and step (and zeroes the gradients).
            engine: Any = model if is_engine(model) else None
            timeline = record_step(
                lambda m=model, b=data: loss_fn(m, b),
                engine.backward if engine else lambda loss: loss.backward(),
                engine.step if engine else lambda o=optimizer: (o.step(), o.zero_grad()),
                state_before={
                    "params": state.params,
                    "grads": state.grads + state.buckets,  # DDP's, held by its reducer
                    "optimizer": state.optimizer + state.master,  # DeepSpeed's fp32 copy
                },
            )
            phase = timeline.phase_at(timeline.times_us[timeline.peak_index])
            tries.append((timeline.unreleased, timeline.peak, phase))
            if _fewest_lost(timeline.unreleased, world_size) <= CLEAN:
                break
        out.append(tries)
    return out


def _fewest_lost(unreleased: int, world_size: int) -> int:
    """The fewest bytes any rank's attempt just now lost (every rank calls it)."""
    if world_size == 1:
        return unreleased
    import torch.distributed as dist

    fewest = torch.tensor([unreleased], dtype=torch.int64)
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
    return int(fewest.item())


def best_attempt(per_rank: list[list[Attempt]]) -> Attempt:
    """Of every rank's attempts at one run, the one that lost fewest releases (then the lowest
    peak: a release lost can only raise it)."""
    return min(attempt for attempts in per_rank for attempt in attempts)


def plan_run(
    strategy: str,
    settings: dict[str, Any],
    *,
    batch: int,
    world_size: int,
    checkpointing: bool = False,
    config: TransformerConfig | None = None,
) -> Any:
    """The planner's figures for the same run (``batch`` split over the ranks), stepping one
    tensor at a time as torch's optimizers do on CPU."""
    return plan(
        demo(config),
        batch_size=batch // world_size,
        seq_len=(config or TransformerConfig()).seq_len,
        world_size=world_size,
        strategy=strategy,
        settings=settings,
        activation_checkpointing="blocks" if checkpointing else None,
        foreach=False,
    )
