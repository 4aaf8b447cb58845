"""record_step leaves nothing of the profiler's own notices in a rank's output.

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

import pytest

from fsdp_guide.timeline import _record

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
        with _record._quiet():
            logger.warning("Mismatch between allocation and free: 199168 vs. 215552")
        logger.warning("outside record_step it is logged as before")
    finally:
        logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert "Mismatch" not in err and "outside record_step" in err
