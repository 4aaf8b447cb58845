"""What a step's own thread allocated, seen two ways, and the releases the profiler misses."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from step_peak_runs import build

from fsdp_guide.launcher import launch
from fsdp_guide.models import loss_fn, shard_batch, synthetic_batch
from fsdp_guide.timeline import record_step


def _both_ways(rank: int, world_size: int, steps: int) -> list[tuple[int, int]]:
    """For FSDP2 steps: the peak of the memory profile's rows and of the allocation events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from fsdp_guide._own_allocations import own_allocations
    from fsdp_guide.timeline._record import _categorised, _uncategorised

    warnings.filterwarnings("ignore")
    model, optimizer = build("fsdp2", {})
    batch = shard_batch(synthetic_batch("transformer", 8), rank, world_size)
    pairs = []
    for _ in range(steps):
        with profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof:
            with record_function("fsdp_guide:forward"):
                loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
        cpu = torch.device("cpu")
        own = own_allocations(prof, "fsdp_guide:forward", cpu)
        # A release lost on gloo's worker thread (a block's buffer) leaves both paths wrong,
        # each its own way (CI saw 7,341,320 and 7,997,448 where clean steps read 7,204,360
        # twice): compare the steps that lost none (a few bytes, the loss, stay).
        if own.unreleased > 64:
            continue
        try:
            _, rows = _categorised(prof, cpu, own.foreign)
        except AssertionError:  # the memory profile rejects some FSDP2 graphs: another step
            continue
        profiled = [sum(row) - sum(rows[0]) for row in rows]
        _, flat = _uncategorised(own.events, 0.0)
        pairs.append((max(profiled), max(sum(row) for row in flat)))
    return pairs


def test_the_memory_profile_and_the_allocation_events_agree_on_the_peak() -> None:
    # Gloo's worker threads allocate staging blocks during FSDP2's collectives; the events of
    # every thread put them in one path and not the other, and the two peaks parted.
    results = launch(_both_ways, world_size=2, args=(6,), start_method="fork")
    pairs = [pair for rank in results for pair in rank]
    assert pairs, "the memory profile rejected, or a lost release spoiled, every step"
    assert all(a == b for a, b in pairs), pairs


def _hand_to(thread_drops: bool) -> int:
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.zeros(2_000))  # 8,000 bytes
        if thread_drops:  # a thread the profiler does not follow lets go of it
            worker = threading.Thread(target=kept.clear)
            worker.start()
            worker.join()
        else:
            kept.clear()

    timeline = record_step(
        lambda: None, lambda _: None, step, state_before={"params": 0, "grads": 0}
    )
    return timeline.unreleased


@pytest.mark.parametrize(("thread_drops", "unreleased"), [(False, 0), (True, 8_000)])
def test_a_release_the_profiler_did_not_see_is_reported(
    thread_drops: bool, unreleased: int
) -> None:
    assert _hand_to(thread_drops) == unreleased
