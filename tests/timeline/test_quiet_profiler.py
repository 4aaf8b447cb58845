"""record_step leaves nothing of the profiler's own notices in a rank's output, and records
again a step whose profile lost a release.

Freeing, inside the recorded step, a block allocated before the profiler started makes
torch's CPU allocator log "Memory block of unknown size was allocated before the profiling
started" straight to file descriptor 2 (and the memory profile logs "Mismatch between
allocation and free" now and then): a lesson's stored output would carry them, timestamped.
Whatever else the step writes to stderr still comes through.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

from fsdp_guide.timeline import _quiet, record_step

STEP = textwrap.dedent(
    """
    import os
    import torch
    from fsdp_guide.timeline import record_step

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = [torch.ones(4096)]  # allocated before the profiler starts


    def forward():
        held.clear()  # freed inside the step
        os.write(2, b"a line the step writes itself\\n")
        return model(torch.randn(8, 64)).sum()


    record_step(forward, lambda loss: loss.backward(), optimizer.step,
                state_before={"params": 64 * 65 * 4})
    """
)


def test_the_allocator_notice_is_dropped_and_other_stderr_kept() -> None:
    run = subprocess.run(
        [sys.executable, "-c", STEP], capture_output=True, text=True, timeout=120, check=True
    )
    assert "allocated before the profiling started" not in run.stderr
    assert "a line the step writes itself" in run.stderr


def test_the_memory_profiles_mismatch_warning_is_silenced(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("torch.profiler._memory_profiler")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        with _quiet.quiet():
            logger.warning("Mismatch between allocation and free: 199168 vs. 215552")
        logger.warning("outside record_step it is logged as before")
    finally:
        logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert "Mismatch" not in err and "outside record_step" in err


def _step_that_loses_a_release_the_first_time(
    lose: bool = True,
) -> tuple[Any, Any, Any, list[int]]:
    """A step whose first run frees a buffer on another thread, where the profiler does not
    see it (as gloo's worker threads do with a collective's buffers); later runs free it on
    the step's own thread."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runs: list[int] = []

    def forward() -> Any:
        runs.append(1)
        held = [torch.ones(100_000)]  # 400,000 bytes
        if lose and len(runs) == 1:
            thread = threading.Thread(target=held.clear)
            thread.start()
            thread.join()
        else:
            held.clear()
        return model(torch.randn(8, 64)).sum()

    return forward, (lambda loss: loss.backward()), optimizer.step, runs


@pytest.mark.parametrize(("attempts", "runs", "lost"), [(1, 1, True), (3, 2, False)])
def test_a_step_that_lost_a_release_is_recorded_again(attempts: int, runs: int, lost: bool) -> None:
    forward, backward, step, ran = _step_that_loses_a_release_the_first_time()
    timeline = record_step(
        forward, backward, step, state_before={"params": 64 * 65 * 4}, attempts=attempts
    )
    assert len(ran) == runs
    assert (timeline.unreleased >= 400_000) is lost


def test_attempts_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="attempts is how many steps"):
        record_step(lambda: None, lambda _: None, lambda: None, state_before={}, attempts=0)


def _two_ranks_one_losing(rank: int, world_size: int) -> tuple[int, int]:
    """Rank 0 loses a release in its first step, rank 1 never: both must record again."""
    import torch.distributed as dist

    forward, backward, step, ran = _step_that_loses_a_release_the_first_time(lose=rank == 0)

    def forward_on_rank() -> Any:
        loss = forward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # a collective in every step: a rank that stops early hangs
        return loss

    timeline = record_step(
        forward_on_rank, backward, step, state_before={"params": 64 * 65 * 4}, attempts=3
    )
    return len(ran), timeline.unreleased


def test_the_ranks_agree_on_recording_another_step() -> None:
    from fsdp_guide.launcher import launch

    results = launch(_two_ranks_one_losing, world_size=2, timeout=180)
    assert [steps for steps, _ in results] == [2, 2]
    assert all(unreleased < 400_000 for _, unreleased in results)
